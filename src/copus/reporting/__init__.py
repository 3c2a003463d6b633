"""Reading run folders and turning them into plots and tables (no torch)."""
