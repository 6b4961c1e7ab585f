"""Host-memory readers: procfs text parsers, a psutil stand-in, allocator counter classes.
Stdlib (+ psutil) only: nothing here imports torch or lightning."""
