"""The foundation every layer stands on: one-line errors, shared constants, atomic writes,
restricted unpickling, the process runtime (threads, precision, allocator) and progress lines.
Imports nothing else of lgvit."""
