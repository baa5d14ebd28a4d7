"""The activator: holds requests while capacity comes up, picks a ready instance, streams the answer.

Nothing lives here yet. It will hold, per deployment, a bounded queue of requests with deadlines, the
load-balancing policy (least outstanding requests) and the unbuffered streaming proxy (aiohttp). It
imports none of Stoker's other packages: the composition root wires it to the warm pool through a
small protocol declared here.
"""
