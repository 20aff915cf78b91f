"""moto's SQS server for the tests (benchmarks/sqs_server.py: the chaos harness uses it too).

``.ci/run`` starts one ``moto_server`` on a free loopback port and exports its port as
``LEASE_TEST_SQS_PORT``; without it (a developer's ``pytest``) each test process starts one of
its own. Tests keep apart by queue names, which are their own (``lease-tests-<run>``).
"""

from benchmarks.sqs_server import REGION, broker_url, sqs_client, sqs_port, transport_options

__all__ = ["REGION", "broker_url", "sqs_client", "sqs_port", "transport_options"]
