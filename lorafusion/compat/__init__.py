"""Explicit, versioned shims for the libraries lorafusion builds on (``megatron``: megatron-core 0.16.x).
Nothing here imports the rest of lorafusion: what a shim needs of ours is handed to it as a callable."""
