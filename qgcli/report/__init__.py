"""What a user reads: summaries and their JSON, terminal tables and text, figures, per-layer reports, verify."""
