"""Client-server speculative decoding: the drafter on the user's device, the target on a server
that verifies many clients' drafts in batched passes (the MoA paper's section 4.2)."""
