"""Stoker's control plane, data plane and composition root, by role (each folder's docstring says
what may import it; imports point down only):

    cli/      parse flags → values → call one function            (the top)
    serve/    the three process shapes, each wired in one function
    api/      the admin HTTP API, one module per resource
    control/  deployments, revisions, rollout, keys, routes, cost, what gateways learn
    gateway/  one request: auth, limits, split, cascade, taps, the hand-off to the activator
    engine/   the CPU engine        node/  the node agent
    spec/     every field's type, default, range and validation; what the planes send each other
    tls/      TLS between the planes and to the engines: the files, one context per kind of peer,
              and a self-signed set (`stoker tls init`)

and three shared helpers: `errors` (ours, and the one HTTP shape), `http` (pure-ASGI pieces),
`paths` (where data lives).
"""
