"""The edges above the first-order pipeline: torch.compile's ops and the derivative layer."""
