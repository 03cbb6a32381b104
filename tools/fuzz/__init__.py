"""Layout fuzzing: seeded draws from the layout space (:mod:`.sampler`), each trained and compared with
its serial twin and resumed under a second layout (:mod:`.checker`), and pairwise coverage of a campaign
(:mod:`.coverage`); a planned run scaled down to this machine (:mod:`.scale`). docs/fuzzing.md."""
