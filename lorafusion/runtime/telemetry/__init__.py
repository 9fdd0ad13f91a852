"""What a training run reports: metrics rows and progress (``metrics``), stage timers (``timers``), the plan
report (``report``) and the status writer (``status``)."""
