"""Model building blocks: norms, rotary embedding, attention over the paged KV pool, Gated DeltaNet."""
