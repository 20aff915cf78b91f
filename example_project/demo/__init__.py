"""``python -m example_project demo``: the failure story, played on real workers, twice.

Modules, in the order data flows: ``cluster`` (the processes), ``brokers`` (what each broker
does with a killed worker's message, and what it still holds), ``stage`` (what a scene acts
on), ``scenes`` (the story), ``history`` (events -> facts), ``tally`` (facts -> the table),
``table`` and ``picture`` (the output), ``run`` (all of it, once per mode).
"""
