-- oncely 0001: the outbox, receipts, local tasks and inbound idempotency keys.
-- Runs inside one transaction with search_path set to the target schema.

CREATE TABLE oncely_outbox (
    id              uuid NOT NULL,
    seq             bigint GENERATED ALWAYS AS IDENTITY,
    aggregatetype   text NOT NULL,
    aggregateid     text NOT NULL,
    type            text NOT NULL,
    topic           text NOT NULL,
    payload         bytea NOT NULL,
    headers         jsonb NOT NULL DEFAULT '{}'::jsonb,
    event_key       text NOT NULL,
    status          text NOT NULL DEFAULT 'pending'::text,
    attempts        integer NOT NULL DEFAULT 0,
    available_at    timestamptz NOT NULL DEFAULT now(),
    lease_owner     text,
    lease_until     timestamptz,
    last_error      text,
    published_at    timestamptz,
    kafka_partition integer,
    kafka_offset    bigint,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT oncely_outbox_pkey PRIMARY KEY (id),
    CONSTRAINT oncely_outbox_event_key_key UNIQUE (event_key),
    CONSTRAINT oncely_outbox_status_check
        CHECK (status IN ('pending', 'published', 'dead', 'skipped'))
);
-- The relay claims due rows in seq order ...
CREATE INDEX oncely_outbox_pending_seq_idx ON oncely_outbox (seq) WHERE status = 'pending';
-- ... and only the head (lowest seq) among a key's unsettled rows.
CREATE INDEX oncely_outbox_key_seq_idx ON oncely_outbox (aggregateid, seq)
    WHERE status = ANY (ARRAY['pending'::text, 'dead'::text]);
-- Retention purge of published rows.
CREATE INDEX oncely_outbox_published_at_idx ON oncely_outbox (published_at)
    WHERE status = 'published';

-- Every insert wakes LISTENing relays at commit, whoever wrote the rows.
CREATE FUNCTION oncely_outbox_notify() RETURNS trigger LANGUAGE plpgsql
    AS $$ BEGIN PERFORM pg_notify('oncely_outbox', ''); RETURN NULL; END $$;
CREATE TRIGGER oncely_outbox_notify AFTER INSERT ON oncely_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION oncely_outbox_notify();

CREATE TABLE oncely_receipts (
    event_id   uuid NOT NULL,
    effect     text NOT NULL,
    topic      text,
    partition  integer,
    "offset"   bigint,
    applied_at timestamptz NOT NULL DEFAULT now(),
    outcome    text NOT NULL DEFAULT 'applied'::text,
    CONSTRAINT oncely_receipts_pkey PRIMARY KEY (event_id, effect)
);
CREATE INDEX oncely_receipts_effect_applied_at_idx ON oncely_receipts (effect, applied_at);

CREATE TABLE oncely_tasks (
    id           uuid NOT NULL,
    task_key     text NOT NULL,
    name         text NOT NULL,
    payload      jsonb NOT NULL,
    policy       text NOT NULL,
    status       text NOT NULL DEFAULT 'queued'::text,
    attempts     integer NOT NULL DEFAULT 0,
    max_attempts integer NOT NULL,
    available_at timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz,
    lease_owner  text,
    lease_until  timestamptz,
    last_error   text,
    result       jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz,
    CONSTRAINT oncely_tasks_pkey PRIMARY KEY (id),
    CONSTRAINT oncely_tasks_task_key_key UNIQUE (task_key),
    CONSTRAINT oncely_tasks_status_check
        CHECK (status IN ('queued', 'leased', 'completed', 'dead', 'failed', 'stale', 'expired')),
    CONSTRAINT oncely_tasks_policy_check CHECK (policy IN ('retry_safe', 'irreversible'))
);
CREATE INDEX oncely_tasks_queued_idx ON oncely_tasks (available_at) WHERE status = 'queued';
CREATE INDEX oncely_tasks_leased_idx ON oncely_tasks (lease_until) WHERE status = 'leased';

CREATE TABLE oncely_idempotency_keys (
    owner       text NOT NULL,
    key         text NOT NULL,
    status      text NOT NULL,
    fingerprint text,
    detail      text,
    result      jsonb,
    extra       jsonb,
    received_at timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    CONSTRAINT oncely_idempotency_keys_pkey PRIMARY KEY (owner, key),
    CONSTRAINT oncely_idempotency_keys_status_check
        CHECK (status IN ('processing', 'accepted', 'rejected')),
    CONSTRAINT oncely_idempotency_keys_key_check CHECK (char_length(key) <= 200)
);
