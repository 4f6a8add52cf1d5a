"""The replicated server on Ray Serve: engine replicas behind one OpenAI ingress (``app.py``),
the replica actors and the pool the HTTP layer drives (``replicas.py``), and the prefix-aware
request router (``routing.py``). Ray Serve code through and through: everything else imports
it lazily."""
