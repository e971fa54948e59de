-- oncely 0011: the operators' audit log.
-- Runs inside one transaction with search_path set to the target schema.
--
-- Every operation that changes the pipeline on an operator's word (requeue or skip a parked
-- row, reclaim a task, republish a window), from the CLI or the console, writes one row here in
-- the operation's own transaction: who asked, through what, what was done to how many rows, and
-- the reason they gave. `oncely audit` and the console's audit page read it back.
CREATE TABLE oncely_audit (
    id      bigint GENERATED ALWAYS AS IDENTITY,
    at      timestamptz NOT NULL DEFAULT now(),
    actor   text NOT NULL,
    via     text NOT NULL,
    action  text NOT NULL,
    target  text NOT NULL,
    rows    integer NOT NULL,
    reason  text NOT NULL DEFAULT ''::text,
    CONSTRAINT oncely_audit_pkey PRIMARY KEY (id),
    CONSTRAINT oncely_audit_via_check CHECK (via IN ('cli', 'web'))
);
CREATE INDEX oncely_audit_at_idx ON oncely_audit (at);
