"""One request's way through the shim: intake, the admission gate, and the answer or the relay.

``proxy.py`` is the shell: it runs the intake (``intake.py``: the checks on the head and
the body, in one order), asks the admission gate (``gate.py``: every refusal for load, over
the controller and its asyncio helper ``waiting.py``), and answers with a refusal
(``serve/api/rejection.py``) or hands the request to the relay (``relay.py``), which forwards
it through the upstream pool (``upstream.py``, ``headers.py``) and streams the answer back.
``exchange.py`` is what one request carries between them; ``disconnect.py`` watches the
client meanwhile.
"""
