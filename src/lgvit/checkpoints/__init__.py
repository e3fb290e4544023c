"""Checkpoint files: the safetensors weights and training state (``files``), the record a
checkpoint carries (``record``) and the kinds of checkpoint, one per task (``kinds``).
Below the model zoo, which loads them; imports only the foundation and the data layer."""
