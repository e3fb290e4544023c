"""What the command line offers beyond training and evaluation: speed and memory (``bench``,
``measure``, ``scaling``), ``export``, attention maps (``viz``, ``plot``) and the released
weights (``weights``). Above the tasks, below the command line."""
