"""What a trainer observes and says of its runs: peaks, step times, the memory report, and
the notice while kernels compile."""
