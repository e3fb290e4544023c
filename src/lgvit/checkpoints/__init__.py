"""Checkpoint files: the safetensors weights and training state (``files``), the record a
checkpoint carries (``record``), the kinds of detection checkpoint, one per detector
(``kinds``), and the names of a run folder's files (``run_layout``). Below the model zoo, which
loads them; imports only the foundation, the data layer and the task table."""
