"""The tasks' code: one package per task, each with the same three modules:

- ``train``: the task on the shared run (:class:`lgvit.run.engine.Task`), made by ``make_task()``;
- ``evaluate``: its metrics and the loading of its checkpoints (never imports the engine);
- ``cli``: ``lgvit eval`` / ``lgvit predict`` of its checkpoints: ``EVAL_FLAGS`` and
  ``PREDICT_FLAGS`` (the flags it reads beyond the common ones), ``run_eval(args)`` and
  ``run_predict(args)``;

and, in its ``__init__``, ``build_released(w)`` (the model a released file of the task loads
into). What a task is -- its name, dense or not, its checkpoints' record defaults, datasets,
test-time augmentations, words in messages -- is :mod:`lgvit.task_table`'s, below the
checkpoints. A task's name leads to its code through plain imports: :mod:`lgvit.tasks.dispatch`
holds each task's ``cli`` and ``build_released`` (``lgvit eval`` and ``predict`` never import
training), :mod:`lgvit.tasks.run` each task's ``train``.
"""
