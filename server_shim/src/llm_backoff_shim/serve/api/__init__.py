"""What the shim's clients see of it: the routes it serves (``routes.py``), the API keys it
accepts (``auth.py``) and its own answers, the refusals (``rejection.py``). Values and their
renderers, importing nothing else of ``serve/``: the settings check against them, and the
policies and the request path answer with them."""
