-- oncely 0002: what the task worker needs from oncely_tasks.
-- Runs inside one transaction with search_path set to the target schema.

-- Retention purge of terminal tasks (stale tasks wait for an operator and are never purged).
CREATE INDEX oncely_tasks_finished_at_idx ON oncely_tasks (finished_at)
    WHERE status = ANY (ARRAY['completed'::text, 'dead'::text, 'failed'::text, 'expired'::text]);

-- Every insert wakes LISTENing task workers at commit, whoever wrote the rows.
CREATE FUNCTION oncely_tasks_notify() RETURNS trigger LANGUAGE plpgsql
    AS $$ BEGIN PERFORM pg_notify('oncely_tasks', ''); RETURN NULL; END $$;
CREATE TRIGGER oncely_tasks_notify AFTER INSERT ON oncely_tasks
    FOR EACH STATEMENT EXECUTE FUNCTION oncely_tasks_notify();
