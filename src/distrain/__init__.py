"""distrain: communication-efficient distributed training over slow, uneven or shared networks."""
