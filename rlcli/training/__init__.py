"""Training: the LightningModule, the step plan, collectives, step sources, optimizer, strategy."""
