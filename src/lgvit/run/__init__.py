"""The training run every task shares: its configuration (``config``), the loop (``engine``), the
optimizer and schedule (``optim``), the run folder and its resume (``rundir``) and preemption
(``preempt``). Tasks plug into it; nothing below imports it."""
