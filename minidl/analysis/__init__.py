"""Where the bytes go: dry runs, estimate tables, reports, summaries, memory recording."""
