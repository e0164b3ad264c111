"""The front doors: the control socket, the HTTP API and its tokens, SQL as the asking user, the metrics endpoint, a followed jobs file."""
