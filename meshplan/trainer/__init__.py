"""``meshplan train``: a driver of the resident job that runs a training plan's steps
(``training/step_model.py`` made the step; the job keeps the weights and the optimizer's
state on their ranks): data batches, the learning-rate schedule, checkpoints, export."""
