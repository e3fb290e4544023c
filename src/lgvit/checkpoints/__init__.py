"""Checkpoint files: the safetensors weights and training state (``files``), the record a
checkpoint carries (``record``), the kinds of checkpoint, one per task (``kinds``), and the
names of a run folder's files (``run_layout``).
Below the model zoo, which loads them; imports only the foundation and the data layer."""
