"""Checkpoints and recovery of one store's state (no re-exports: import the modules).

    checkpointing  Checkpointing      writes this rank's shards of a committed step; restores
                                      any layout from a checkpoint; the meta of restored steps
    agreement      RecoveryAgreement  the ``recovery/`` records in etcd: the plan every rank of a
                                      recovering session follows, and each rank's outcome
    recovery       Recovery           ``Store.recover``: fence, agree on one step and one
                                      source, fetch it, republish it

``astate_store.checkpoint`` knows no etcd; these modules are the glue between it, the catalog and
the store's publisher and consumer.
"""
