"""Daily tools over the public API: the benchmark timer (minidl bench)."""
