"""The consuming side: effect apps (:mod:`.effects`), each applied once through receipts by its
own consumer (:mod:`.runner`, :mod:`.apply`), with its failure policy and dead letters
(:mod:`.failures`, :mod:`.dlq`); replay by offsets (:mod:`.replay`), receipt retention
(:mod:`.receipts`) and completeness (:mod:`.completeness`). Durable tasks are
:mod:`oncely.tasks`."""
