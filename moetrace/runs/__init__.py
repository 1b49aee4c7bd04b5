"""A run of the engine over prompts or a trace: shared set-up, preflight checks, record, replay."""
