"""minidl.memory: devices, the heap pool, plans, and memory policies. Never imports minidl or layers."""
