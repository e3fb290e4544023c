"""Checkpoint files: the safetensors weights and training state (``files``), the record a
checkpoint carries (``record``) and the kinds of detection checkpoint, one per detector
(``kinds``). Below the model zoo, which loads them; imports only the foundation, the data layer
and the task table."""
