"""The cluster a job runs on: rendezvous and launches (:mod:`.rendezvous`), peers and lost-peer errors
(:mod:`.peers`), the links between machines (:mod:`.probe`), this process's sockets (:mod:`.sockets`) and the
replicas' agreement at start (:mod:`.fingerprint`)."""
