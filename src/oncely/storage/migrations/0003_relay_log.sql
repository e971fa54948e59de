-- oncely 0003: the relay reads the outbox as a log (snapshot differences per leased key shard).
-- Runs inside one transaction with search_path set to the target schema. The shard count S
-- is fixed here: SET LOCAL oncely.shards (oncely db upgrade --shards), default 32.
--
-- Outbox rows become immutable: the per-row relay columns go, each row gets the id of the
-- transaction that wrote it (txid) and its key's shard. Rows pending at upgrade time are
-- published exactly once by the new relay; dead rows park their keys.

DO $$
DECLARE
    leased bigint;
BEGIN
    SELECT count(*) INTO leased FROM oncely_outbox
    WHERE status = 'pending' AND lease_until > now();
    IF leased > 0 THEN
        RAISE EXCEPTION USING MESSAGE = 'oncely db upgrade: ' || leased || ' outbox row(s) are '
            || 'leased by a running relay: stop every relay, wait for the leases to expire '
            || '(ONCELY_RELAY_LEASE_SECONDS) and retry';
    END IF;
END $$;

DROP TRIGGER oncely_outbox_notify ON oncely_outbox;
DROP FUNCTION oncely_outbox_notify();
DROP INDEX oncely_outbox_pending_seq_idx;
DROP INDEX oncely_outbox_key_seq_idx;
DROP INDEX oncely_outbox_published_at_idx;

-- Progress and lease of each shard: ``done`` is the snapshot whose rows are all acknowledged;
-- while a newer snapshot is read page by page, ``reading`` is it and ``after_seq`` the last
-- acknowledged seq of it. The lease is on the database clock; a takeover bumps ``epoch``.
CREATE TABLE oncely_relay_shards (
    shard       smallint NOT NULL,
    done        pg_snapshot NOT NULL,
    reading     pg_snapshot,
    after_seq   bigint NOT NULL DEFAULT 0,
    owner       text,
    epoch       bigint NOT NULL DEFAULT 0,
    lease_until timestamptz,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT oncely_relay_shards_pkey PRIMARY KEY (shard)
);

-- The relays alive now (heartbeat on the database clock): shards are shared among them.
-- ``asleep``: the relay waits for a NOTIFY, so staging sends one (only then).
CREATE TABLE oncely_relay_members (
    relay_id        text NOT NULL,
    heartbeat_until timestamptz NOT NULL,
    asleep          boolean NOT NULL DEFAULT false,
    CONSTRAINT oncely_relay_members_pkey PRIMARY KEY (relay_id)
);

-- A key whose next row cannot be published yet: a dead row (permanent failure) or a delayed
-- one (available_at in the future). Later rows of the key are held until it is released.
CREATE TABLE oncely_relay_parked (
    topic       text NOT NULL,
    aggregateid text NOT NULL,
    shard       smallint NOT NULL,
    event_id    uuid NOT NULL,
    reason      text NOT NULL,
    error       text,
    until       timestamptz,
    request     text,
    parked_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT oncely_relay_parked_pkey PRIMARY KEY (topic, aggregateid),
    CONSTRAINT oncely_relay_parked_reason_check CHECK (reason IN ('dead', 'delayed')),
    CONSTRAINT oncely_relay_parked_request_check CHECK (request IN ('requeue', 'skip'))
);

-- Rows read behind a parked key, in read order; published when the key is released.
CREATE TABLE oncely_relay_held (
    position    bigint GENERATED ALWAYS AS IDENTITY,
    event_id    uuid NOT NULL,
    topic       text NOT NULL,
    aggregateid text NOT NULL,
    CONSTRAINT oncely_relay_held_pkey PRIMARY KEY (position),
    CONSTRAINT oncely_relay_held_key_fkey FOREIGN KEY (topic, aggregateid)
        REFERENCES oncely_relay_parked (topic, aggregateid)
);
CREATE INDEX oncely_relay_held_key_idx ON oncely_relay_held (topic, aggregateid, position);

-- Rows already settled keep a txid every snapshot sees (2: frozen); rows still to publish get
-- this transaction's, which the initial snapshot below leaves unseen: the first read after
-- commit publishes them, once.
ALTER TABLE oncely_outbox ADD COLUMN txid xid8;
UPDATE oncely_outbox SET txid = CASE WHEN status IN ('pending', 'dead') THEN pg_current_xact_id()
                                     ELSE '2'::xid8 END;
ALTER TABLE oncely_outbox ALTER COLUMN txid SET NOT NULL,
                          ALTER COLUMN txid SET DEFAULT pg_current_xact_id();

DO $$
DECLARE
    shards integer := coalesce(nullif(current_setting('oncely.shards', true), ''), '32')::integer;
    start pg_snapshot;
BEGIN
    IF shards < 1 OR shards > 1024 THEN
        RAISE EXCEPTION USING MESSAGE = 'oncely.shards = ' || shards
            || ': choose between 1 and 1024 shards';
    END IF;
    -- The shard of a row: the first 28 bits of md5(topic, 0x1f, key), modulo S. md5 is stable
    -- across PostgreSQL versions (hashtext is not) and oncely.wire.shard_of computes the same.
    EXECUTE 'ALTER TABLE oncely_outbox ADD COLUMN shard smallint NOT NULL GENERATED ALWAYS AS '
        || '(mod((''x'' || substr(md5(topic || chr(31) || aggregateid), 1, 7))::bit(28)::integer, '
        || shards || ')) STORED';
    -- Everything committed before now, but not this transaction's rows: they are "new".
    SELECT (least(pg_snapshot_xmin(s), pg_current_xact_id())::text || ':'
            || greatest(pg_snapshot_xmax(s)::text::bigint,
                        pg_current_xact_id()::text::bigint + 1)::text || ':'
            || array_to_string(ARRAY(SELECT x FROM pg_snapshot_xip(s) AS x
                                     UNION SELECT pg_current_xact_id() ORDER BY 1), ','))::pg_snapshot
    INTO start FROM pg_current_snapshot() AS s;
    INSERT INTO oncely_relay_shards (shard, done)
    SELECT n, start FROM generate_series(0, shards - 1) AS n;
END $$;

-- Dead rows park their keys; the pending rows of those keys are held behind them when read.
INSERT INTO oncely_relay_parked (topic, aggregateid, shard, event_id, reason, error)
SELECT DISTINCT ON (topic, aggregateid) topic, aggregateid, shard, id, 'dead', last_error
FROM oncely_outbox WHERE status = 'dead' ORDER BY topic, aggregateid, seq;

ALTER TABLE oncely_outbox
    DROP CONSTRAINT oncely_outbox_status_check,
    DROP COLUMN status, DROP COLUMN attempts, DROP COLUMN lease_owner,
    DROP COLUMN lease_until, DROP COLUMN last_error, DROP COLUMN published_at,
    DROP COLUMN kafka_partition, DROP COLUMN kafka_offset;

-- The snapshot reads: a shard's rows by transaction id.
CREATE INDEX oncely_outbox_shard_txid_idx ON oncely_outbox (shard, txid);

-- Staging wakes a relay only while one sleeps: no NOTIFY (and its commit lock) under load.
CREATE FUNCTION oncely_outbox_wake() RETURNS trigger LANGUAGE plpgsql
    SET search_path FROM CURRENT
    AS $$ BEGIN
        IF EXISTS (SELECT 1 FROM oncely_relay_members WHERE asleep) THEN
            PERFORM pg_notify('oncely_outbox', '');
        END IF;
        RETURN NULL;
    END $$;
CREATE TRIGGER oncely_outbox_wake AFTER INSERT ON oncely_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION oncely_outbox_wake();
