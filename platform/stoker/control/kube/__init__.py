"""The control plane's state on a cluster, kept in the API server (a controller has no volume):

    StokerDeployment, StokerRevision  registry.ResourceRegistry  (the SQLite `Registry`'s interface)
    StokerDeployment ─watch─▶ reconcile.Reconciler ─▶ Platform.deploy / remove, and the status back
    Secrets labelled stoker.dev/key   keys.SecretKeyStore        (the SQLite `KeyStore`'s)
    StokerRoute                       routes.ResourceRoutes      (the SQLite `CascadeRoutes`')
    ConfigMaps stoker-checkpoint-*    checkpoints.ConfigMapCheckpointStore (the data dir's files)

Each reads a `mirror.Mirror` (list and watch), never the API server itself, and writes with the
resourceVersion it read: a write over someone else's is refused (409), not made.
"""
