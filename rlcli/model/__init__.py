"""The policy model: building it, the scorer (hidden states -> head), varlen attention, sharding."""
