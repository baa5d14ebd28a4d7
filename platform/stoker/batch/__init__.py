"""OpenAI's batch API: `/v1/files` and `/v1/batches`, served by `stoker up`.

    client ─▶ /v1/files (multipart, bounded) ─▶ FileStore      <data dir>/files/<tenant>/
           ─▶ /v1/batches ─▶ BatchStore (one JSON record a batch) <data dir>/batches/<tenant>/
                                 │
                 BatchRunner: one task per unfinished batch
                   validate the input (bad lines go to the error file at once)
                   dispatch each line through the gateway's own InferenceEndpoint (keys, limits,
                   cost, the activator's hold queue at BATCH_PRIORITY), paced by `pacing`
                   append each answer to the output or error file (`results.ResultLog`)
                   finalize: the two files become File objects; the record says completed

The modules, one concept each: `config` (the settings and their bounds), `files` (the tenant's
files on disk), `objects` (their bytes in object storage, where one is configured), `multipart`
(the upload's streaming parser), `lines` (what a request body and an input line must be),
`records` (the batch object and its store), `results` (the output and error files, which are also
the journal of what is done), `pacing` (the pure decision of how many lines may go now), `cost` (a
batch's share of its deployments' spend), `runner` (the loop), `inprocess` (one line sent through
the gateway's endpoint in this process), `routes` (HTTP), `schema` (the OpenAPI paths).

A tenant is a key's tenant (`spec.keys.Principal.tenant`); the admin's files and batches are the
admin's own. Nothing here imports the control plane.
"""
