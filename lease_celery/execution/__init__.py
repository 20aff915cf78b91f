"""A LeasedTask delivery's path below the task class: how an attempt ends
(``attempts``), the finish sent in the background, the settle phase, answers to duplicates,
uniqueness at publish, re-publishing (``delivery``)."""
