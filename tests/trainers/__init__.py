"""Training frameworks over a model that holds a FlaxModule: DDP, FSDP2, Lightning, accelerate."""
