-- PostgreSQL dialect (psycopg, %(name)s parameters). {schema} is replaced by the quoted schema
-- name. Every decision reads the server clock inside the statement (clock_timestamp()), unless
-- the store was opened with an injected clock, which is passed as %(now)s; the worker's own
-- clock is never used. Times are epoch seconds (double precision), as everywhere in the library.

-- name: lock_schema
SELECT pg_advisory_xact_lock(hashtext('lease_celery.schema'))

-- name: create_schema
CREATE SCHEMA IF NOT EXISTS {schema}

-- name: create_leases
CREATE TABLE IF NOT EXISTS {schema}.lease_celery_leases (
    key         text             PRIMARY KEY,
    -- 'purged': a tombstone that keeps the key's token after purge (see below); never shown.
    state       text             NOT NULL
                CHECK (state IN ('ready', 'running', 'done', 'dead', 'purged')),
    owner       text,
    token       bigint           NOT NULL CHECK (token >= 0),
    expires_at  double precision,
    attempts    integer          NOT NULL DEFAULT 0,  -- claims so far (reset by requeue)
    takeovers   integer          NOT NULL DEFAULT 0,  -- claims that found the lease expired
    not_before  double precision,                     -- backoff: not claimable before this
    reason      text,                                 -- last error, why dead, operator's note
    task        text,                                 -- JSON: what re-publishes the task
    swept_token bigint,                               -- expired token a sweeper re-published
    nonce       text,                                 -- the claim call that wrote this token
    result      text,  -- JSON as the library wrote it (jsonb would refuse \u0000, reshape numbers)
    updated_at  double precision NOT NULL,
    fence       bigint           NOT NULL DEFAULT 0,
    -- Schema 2. settling: done (or dead) and the owner has not yet confirmed that Celery
    -- stored the outcome; expires_at is then the settle deadline. sweep_at: when the sweeper
    -- should look at the row next (NULL: never), read through a partial index. swept_by: the
    -- sweep call that last re-published the row (a re-sent sweep reports exactly its own).
    settling    boolean          NOT NULL DEFAULT false,
    sweep_at    double precision,
    swept_by    text,
    -- Schema 3: the holder's latest progress checkpoint (JSON), and 'cancelled: ...' once an
    -- operator cancelled the key.
    checkpoint  text,
    cancel      text,
    -- Schema 6: the limit group a limited claim took, and the slot token it was granted.
    grp         text,
    slot        bigint
)

-- name: migrate_columns
ALTER TABLE {schema}.lease_celery_leases
    ADD COLUMN IF NOT EXISTS settling boolean NOT NULL DEFAULT false,
    ADD COLUMN IF NOT EXISTS sweep_at double precision,
    ADD COLUMN IF NOT EXISTS swept_by text,
    ADD COLUMN IF NOT EXISTS checkpoint text,
    ADD COLUMN IF NOT EXISTS cancel text,
    ADD COLUMN IF NOT EXISTS grp text,
    ADD COLUMN IF NOT EXISTS slot bigint

-- name: migrate_fill_sweep_at
-- Schema 1 -> 2: rows the sweeper must keep watching get their next look; done rows of schema
-- 1 were settled by definition (no settle phase existed).
UPDATE {schema}.lease_celery_leases
SET sweep_at = CASE WHEN state = 'running' THEN expires_at
                    ELSE COALESCE(not_before, updated_at) END
WHERE state IN ('running', 'ready') AND task IS NOT NULL

-- name: create_terminal_index
-- Retention reads the oldest terminal rows, and only those.
CREATE INDEX IF NOT EXISTS lease_celery_leases_terminal
ON {schema}.lease_celery_leases (updated_at) WHERE state IN ('done', 'dead')

-- name: create_sweep_index
CREATE INDEX IF NOT EXISTS lease_celery_leases_sweep ON {schema}.lease_celery_leases (sweep_at)
WHERE sweep_at IS NOT NULL

-- name: create_live_index
-- Schema 7: the operator's reads of live rows (find by state, stats, the dashboard's lists)
-- walk this instead of the table. Only live rows: a claim adds an entry and a finish takes it
-- away, so it stays the size of the work in hand, however many rows are settled.
CREATE INDEX IF NOT EXISTS lease_celery_leases_live ON {schema}.lease_celery_leases
(state, updated_at) WHERE state IN ('ready', 'running')

-- name: create_dead_index
-- Schema 7: dead rows, few among the settled ones (the dashboard's dead list, stats).
CREATE INDEX IF NOT EXISTS lease_celery_leases_dead ON {schema}.lease_celery_leases (updated_at)
WHERE state = 'dead'

-- name: create_effects_state_index
-- Schema 8: the receipts of one state (the reconcile queue: effect_find, the Django admin's
-- state filter) are a range of this, newest first; without it a rare state was found by
-- reading every receipt.
CREATE INDEX IF NOT EXISTS lease_celery_effects_state ON {schema}.lease_celery_effects
(state, updated_at)

-- name: create_slots_index
-- Schema 6: a group's running count reads only its running rows (lease_celery.limits).
CREATE INDEX IF NOT EXISTS lease_celery_leases_slots ON {schema}.lease_celery_leases
(grp, expires_at) WHERE grp IS NOT NULL AND state = 'running'

-- name: create_limits
-- Schema 6: one row per limit group. task_*: the limit and rate its tasks ask for (the latest
-- claim's); set_*: an operator's (celery leases limit), which win (NULL: the task's; 0 and ''
-- lift it). tat: the next allowed start of a rate-limited group (GCRA's theoretical arrival
-- time); slots: the slot tokens granted so far; seq: the waiters' arrival counter. A limited
-- claim locks its group's row: the claims of one group are serialised, no others.
CREATE TABLE IF NOT EXISTS {schema}.lease_celery_limits (
    grp           text             PRIMARY KEY,
    task_limit    integer,
    task_rate     text,
    task_interval double precision,
    set_limit     integer,
    set_rate      text,
    set_interval  double precision,
    tat           double precision,
    slots         bigint           NOT NULL DEFAULT 0,
    seq           bigint           NOT NULL DEFAULT 0,
    updated_at    double precision NOT NULL
)

-- name: create_waiters
-- Schema 6: deliveries parked over their group's limit, one per key, in arrival order (seq),
-- with the task info that publishes them again; handed_at: when a freed slot handed it on.
CREATE TABLE IF NOT EXISTS {schema}.lease_celery_waiters (
    grp        text             NOT NULL,
    key        text             NOT NULL,
    seq        bigint           NOT NULL,
    task       text,
    since      double precision NOT NULL,
    handed_at  double precision,
    PRIMARY KEY (grp, key)
)

-- name: create_waiters_order_index
CREATE INDEX IF NOT EXISTS lease_celery_waiters_order ON {schema}.lease_celery_waiters (grp, seq)

-- name: create_claim_limited_function
-- The limited claim (Store.claim_limited) in one round trip. Each statement of a plpgsql
-- function reads a fresh snapshot under READ COMMITTED, so the running count below is read
-- after the group's row is locked: it sees every claim of the group committed before ours.
-- The verdict is stores.base.group_verdict's rule; the claim statement is the claim query's.
CREATE OR REPLACE FUNCTION {schema}.lease_celery_claim_limited(
    p_key text, p_owner text, p_ttl double precision, p_task text, p_nonce text,
    p_now double precision, p_grp text, p_limit integer, p_rate text,
    p_interval double precision)
RETURNS TABLE (verdict text, token bigint, expires_at double precision, fence bigint,
               attempts integer, takeovers integer, cancel text, slot bigint,
               waiting bigint, running bigint, lim integer, retry_at double precision)
LANGUAGE plpgsql AS $fn$
#variable_conflict use_column
DECLARE
    g {schema}.lease_celery_limits%ROWTYPE;
    t double precision;
    n_running bigint;
    n_ahead bigint;
    my_seq bigint;
    eff_limit integer;
    eff_interval double precision;
    c record;
BEGIN
    INSERT INTO {schema}.lease_celery_limits AS l
           (grp, task_limit, task_rate, task_interval, updated_at)
    VALUES (p_grp, p_limit, p_rate, p_interval,
            COALESCE(p_now, extract(epoch FROM clock_timestamp())::double precision))
    ON CONFLICT (grp) DO UPDATE SET task_limit = EXCLUDED.task_limit,
        task_rate = EXCLUDED.task_rate, task_interval = EXCLUDED.task_interval
    WHERE l.task_limit IS DISTINCT FROM EXCLUDED.task_limit
       OR l.task_rate IS DISTINCT FROM EXCLUDED.task_rate
       OR l.task_interval IS DISTINCT FROM EXCLUDED.task_interval;
    SELECT * INTO g FROM {schema}.lease_celery_limits l WHERE l.grp = p_grp FOR UPDATE;
    t := COALESCE(p_now, extract(epoch FROM clock_timestamp())::double precision);
    eff_limit := CASE WHEN g.set_limit IS NOT NULL THEN nullif(g.set_limit, 0)
                      ELSE g.task_limit END;
    eff_interval := CASE WHEN g.set_interval IS NOT NULL THEN nullif(g.set_interval, 0)
                         ELSE g.task_interval END;
    IF EXISTS (SELECT 1 FROM {schema}.lease_celery_leases l
               WHERE l.key = p_key AND l.state <> 'purged'
                 AND NOT ((l.state = 'ready' AND (l.not_before IS NULL OR l.not_before <= t))
                          OR (l.state = 'running' AND l.expires_at <= t))) THEN
        DELETE FROM {schema}.lease_celery_waiters w WHERE w.grp = p_grp AND w.key = p_key;
        RETURN;  -- the key itself refuses
    END IF;
    SELECT count(*) INTO n_running FROM {schema}.lease_celery_leases l
    WHERE l.grp = p_grp AND l.state = 'running' AND l.expires_at > t AND l.key <> p_key;
    SELECT w.seq INTO my_seq FROM {schema}.lease_celery_waiters w
    WHERE w.grp = p_grp AND w.key = p_key;
    SELECT count(*) INTO n_ahead FROM {schema}.lease_celery_waiters w
    WHERE w.grp = p_grp AND (my_seq IS NULL OR w.seq < my_seq);
    IF eff_limit IS NOT NULL AND n_running + n_ahead >= eff_limit THEN
        IF p_task IS NOT NULL AND my_seq IS NULL THEN
            INSERT INTO {schema}.lease_celery_waiters (grp, key, seq, task, since)
            VALUES (p_grp, p_key, g.seq + 1, p_task, t);
            UPDATE {schema}.lease_celery_limits l SET seq = l.seq + 1 WHERE l.grp = p_grp;
        ELSIF p_task IS NOT NULL THEN  -- handed on and refused again: it keeps its place
            UPDATE {schema}.lease_celery_waiters w SET handed_at = NULL
            WHERE w.grp = p_grp AND w.key = p_key;
        END IF;
        RETURN QUERY SELECT 'limit'::text, NULL::bigint, NULL::double precision, NULL::bigint,
            NULL::integer, NULL::integer, NULL::text, NULL::bigint,
            (SELECT count(*) FROM {schema}.lease_celery_waiters w WHERE w.grp = p_grp),
            n_running, eff_limit, NULL::double precision;
        RETURN;
    END IF;
    IF eff_interval IS NOT NULL AND g.tat IS NOT NULL AND g.tat > t THEN
        RETURN QUERY SELECT 'rate'::text, NULL::bigint, NULL::double precision, NULL::bigint,
            NULL::integer, NULL::integer, NULL::text, NULL::bigint, 0::bigint, n_running,
            eff_limit, g.tat;
        RETURN;
    END IF;
    INSERT INTO {schema}.lease_celery_leases AS l
           (key, state, owner, token, expires_at, attempts, takeovers, result, updated_at,
            fence, task, nonce, sweep_at, grp, slot)
    VALUES (p_key, 'running', p_owner, 1, t + p_ttl, 1, 0, NULL, t,
            nextval('{schema}.lease_celery_fence'), p_task, p_nonce,
            CASE WHEN p_task IS NULL THEN NULL ELSE t + p_ttl END, p_grp, g.slots + 1)
    ON CONFLICT (key) DO UPDATE SET
        {fragment_claim_takes_the_row}
        grp        = EXCLUDED.grp,
        slot       = EXCLUDED.slot
    WHERE l.state = 'purged'
       OR (l.state = 'ready' AND (l.not_before IS NULL OR l.not_before <= t))
       OR (l.state = 'running' AND l.expires_at <= t)
    RETURNING l.token, l.expires_at, l.fence, l.attempts, l.takeovers, l.cancel, l.slot
    INTO c;
    IF NOT FOUND THEN
        RETURN;  -- a claim of the key crossed ours: the key refuses
    END IF;
    UPDATE {schema}.lease_celery_limits l
    SET slots = l.slots + 1, updated_at = t,
        tat = CASE WHEN eff_interval IS NULL THEN l.tat
                   ELSE greatest(COALESCE(l.tat, t), t) + eff_interval END
    WHERE l.grp = p_grp;
    DELETE FROM {schema}.lease_celery_waiters w WHERE w.grp = p_grp AND w.key = p_key;
    RETURN QUERY SELECT 'granted'::text, c.token, c.expires_at, c.fence, c.attempts,
        c.takeovers, c.cancel, c.slot, 0::bigint, n_running, eff_limit,
        NULL::double precision;
END
$fn$

-- name: claim_limited
SELECT * FROM {schema}.lease_celery_claim_limited(
    %(key)s, %(owner)s, %(ttl)s, %(task)s, %(nonce)s, %(now)s::double precision, %(grp)s,
    %(limit)s, %(rate)s, %(interval)s)

-- name: hand_on
-- The first waiters of each group (or of %(grp)s) for which a slot is free (all of them once
-- the limit is lifted), but those handed on less than a grace period ago; marked handed. The
-- update checks the mark again: of two hand-ons at once, one hands each waiter.
WITH clock AS (
    SELECT COALESCE(%(now)s::double precision,
                    extract(epoch FROM clock_timestamp())::double precision) AS now
), groups AS (
    SELECT g.grp, CASE WHEN g.set_limit IS NOT NULL THEN nullif(g.set_limit, 0)
                       ELSE g.task_limit END AS lim
    FROM {schema}.lease_celery_limits g
    WHERE (%(grp)s::text IS NULL OR g.grp = %(grp)s)
      AND EXISTS (SELECT 1 FROM {schema}.lease_celery_waiters w WHERE w.grp = g.grp)
), free AS (
    SELECT groups.grp, groups.lim - (
        SELECT count(*) FROM {schema}.lease_celery_leases l, clock
        WHERE l.grp = groups.grp AND l.state = 'running' AND l.expires_at > clock.now) AS free
    FROM groups
), chosen AS (
    SELECT w.grp, w.key FROM free f
    CROSS JOIN LATERAL (
        SELECT w.grp, w.key, w.handed_at FROM {schema}.lease_celery_waiters w
        WHERE w.grp = f.grp ORDER BY w.seq LIMIT f.free) w, clock
    WHERE (f.free IS NULL OR f.free > 0)
      AND (w.handed_at IS NULL OR w.handed_at <= clock.now - %(grace)s)
    LIMIT %(limit)s
)
UPDATE {schema}.lease_celery_waiters w SET handed_at = clock.now
FROM chosen, clock
WHERE w.grp = chosen.grp AND w.key = chosen.key
  AND (w.handed_at IS NULL OR w.handed_at <= clock.now - %(grace)s)
RETURNING w.grp, w.key, w.task, w.since

-- name: limit_set
WITH clock AS (
    SELECT COALESCE(%(now)s::double precision,
                    extract(epoch FROM clock_timestamp())::double precision) AS now
)
INSERT INTO {schema}.lease_celery_limits AS l (grp, set_limit, set_rate, set_interval, updated_at)
SELECT %(grp)s, %(set_limit)s, %(set_rate)s, %(set_interval)s, clock.now FROM clock
ON CONFLICT (grp) DO UPDATE SET
    set_limit    = CASE WHEN %(change_limit)s THEN EXCLUDED.set_limit ELSE l.set_limit END,
    set_rate     = CASE WHEN %(change_rate)s THEN EXCLUDED.set_rate ELSE l.set_rate END,
    set_interval = CASE WHEN %(change_rate)s THEN EXCLUDED.set_interval ELSE l.set_interval END,
    tat          = CASE WHEN %(change_rate)s THEN NULL ELSE l.tat END,
    updated_at   = EXCLUDED.updated_at

-- name: limits_list
WITH clock AS (
    SELECT COALESCE(%(now)s::double precision,
                    extract(epoch FROM clock_timestamp())::double precision) AS now
)
SELECT l.grp, l.task_limit, l.task_rate, l.set_limit, l.set_rate, l.updated_at,
       (SELECT count(*) FROM {schema}.lease_celery_leases r
        WHERE r.grp = l.grp AND r.state = 'running' AND r.expires_at > clock.now) AS running,
       (SELECT count(*) FROM {schema}.lease_celery_waiters w WHERE w.grp = l.grp) AS waiting
FROM {schema}.lease_celery_limits l, clock
WHERE %(grp)s::text IS NULL OR l.grp = %(grp)s
ORDER BY l.grp LIMIT %(limit)s

-- name: create_fence
-- The store-wide fence: a sequence, drawn by every claim (gaps are harmless, order is not lost).
CREATE SEQUENCE IF NOT EXISTS {schema}.lease_celery_fence

-- name: create_history
-- Schema 4: every event of every key (lease_celery.history), pruned by lease_retention.
CREATE TABLE IF NOT EXISTS {schema}.lease_celery_history (
    id      bigserial        PRIMARY KEY,
    key     text             NOT NULL,
    at      double precision NOT NULL,
    event   text             NOT NULL,
    owner   text,
    token   bigint,
    fence   bigint,
    detail  text
)

-- name: create_history_key_index
CREATE INDEX IF NOT EXISTS lease_celery_history_key ON {schema}.lease_celery_history (key, at)

-- name: drop_history_at_index
-- Schema 5: the entries across keys are read, and pruned, in insertion order (id), which the
-- primary key keeps anyway: an index on the time cost every transition a third write.
DROP INDEX IF EXISTS {schema}.lease_celery_history_at

-- name: create_history_function
-- Schema 5: the store writes each key's transitions into its history itself, in the statement
-- that makes them (a trigger: same transaction, no round trip, nothing a crash can lose).
-- Events that are no transition of the row (a local lapse, a refused stale finish, an answer,
-- a sweeper's re-publish, an operator's action) are written by lease_celery.history.
-- A new token is a claim (a takeover if the row was running: its lease had lapsed); running ->
-- done a finish; -> dead with its reason; running -> ready a release, or a retry when a backoff
-- follows; a settling row changing owner a completion (task.py, _complete).
CREATE OR REPLACE FUNCTION {schema}.lease_celery_record_transition() RETURNS trigger
LANGUAGE plpgsql AS $body$
DECLARE
    happened text;
    detail text;
BEGIN
    IF TG_OP = 'INSERT' THEN
        happened := 'claimed';
    ELSIF NEW.token <> OLD.token AND OLD.state = 'running' THEN
        happened := 'taken_over';
        detail := 'the lease of ' || COALESCE(OLD.owner, '?') || ' (token ' || OLD.token
                  || ') had lapsed';
    ELSIF NEW.token <> OLD.token THEN
        happened := 'claimed';
    ELSIF NEW.state = 'done' AND OLD.state = 'running' THEN
        happened := 'finished';
    ELSIF NEW.state = 'dead' AND OLD.state <> 'dead' THEN
        happened := 'dead';
        detail := NEW.reason;
    ELSIF NEW.state = 'ready' AND OLD.state = 'running' AND NEW.not_before > NEW.updated_at THEN
        happened := 'retry';
        detail := COALESCE(NEW.reason, 'released') || '; claimable again in '
                  || round((NEW.not_before - NEW.updated_at)::numeric, 2) || 's';
    ELSIF NEW.state = 'ready' AND OLD.state = 'running' THEN
        happened := 'released';
        detail := NEW.reason;
    ELSIF NEW.settling AND OLD.settling AND NEW.owner IS DISTINCT FROM OLD.owner THEN
        happened := 'completed';
        detail := 'its owner ' || COALESCE(OLD.owner, '?') || ' left the ' || NEW.state
                  || ' key unsettled: completed by this delivery';
    ELSE
        RETURN NULL;
    END IF;
    INSERT INTO {schema}.lease_celery_history (key, at, event, owner, token, fence, detail)
    VALUES (NEW.key, NEW.updated_at, happened, NEW.owner, NEW.token, NEW.fence, detail);
    RETURN NULL;
END
$body$

-- name: create_history_on_claim
CREATE OR REPLACE TRIGGER lease_celery_history_new_key
AFTER INSERT ON {schema}.lease_celery_leases FOR EACH ROW WHEN (NEW.state = 'running')
EXECUTE FUNCTION {schema}.lease_celery_record_transition()

-- name: create_history_on_transition
-- Renewals, settle confirmations and checkpoints match no condition here: the function is
-- not even called for them.
CREATE OR REPLACE TRIGGER lease_celery_history_transition
AFTER UPDATE ON {schema}.lease_celery_leases FOR EACH ROW
WHEN (NEW.token <> OLD.token OR NEW.state <> OLD.state
      OR (NEW.settling AND OLD.settling AND NEW.owner IS DISTINCT FROM OLD.owner))
EXECUTE FUNCTION {schema}.lease_celery_record_transition()

-- name: history_insert_many
INSERT INTO {schema}.lease_celery_history (key, at, event, owner, token, fence, detail)
SELECT * FROM unnest(%(keys)s::text[], %(ats)s::double precision[], %(events)s::text[],
                     %(owners)s::text[], %(tokens)s::bigint[], %(fences)s::bigint[],
                     %(details)s::text[])

-- name: history_of
SELECT key, at, event, owner, token, fence, detail FROM (
    SELECT * FROM {schema}.lease_celery_history WHERE key = %(key)s
    ORDER BY at DESC, id DESC LIMIT %(limit)s) AS h
ORDER BY at, id

-- name: history_many
-- history_of for every key of %(keys)s at once (the dashboard's /running page).
SELECT key, at, event, owner, token, fence, detail FROM (
    SELECT *, row_number() OVER (PARTITION BY key ORDER BY at DESC, id DESC) AS r
    FROM {schema}.lease_celery_history WHERE key = ANY(%(keys)s::text[])) AS h
WHERE r <= %(limit)s
ORDER BY key, at, id

-- name: history_recent
SELECT key, at, event, owner, token, fence, detail FROM (
    SELECT * FROM {schema}.lease_celery_history
    WHERE %(events)s::text[] IS NULL OR event = ANY(%(events)s::text[])
    ORDER BY id DESC LIMIT %(limit)s) AS latest
ORDER BY at DESC, id DESC

-- name: history_prune
-- The oldest entries first, by insertion order: a batch reads the table's first `limit` rows
-- and deletes those older than the cutoff.
DELETE FROM {schema}.lease_celery_history
WHERE id IN (SELECT id FROM {schema}.lease_celery_history ORDER BY id LIMIT %(limit)s)
  AND at < %(cutoff)s

-- name: create_effects
-- Effect receipts (lease_celery.effects): one row per business key. Every change bumps
-- version, and every change is conditional on the version the caller read.
CREATE TABLE IF NOT EXISTS {schema}.lease_celery_effects (
    key          text             PRIMARY KEY,
    fingerprint  text             NOT NULL,
    state        text             NOT NULL
                 CHECK (state IN ('in_flight', 'done', 'needs_reconciliation')),
    lease_key    text,
    lease_token  bigint,
    lease_owner  text,
    started_at   double precision NOT NULL,
    attempts     integer          NOT NULL,
    result       text,
    version      bigint           NOT NULL,
    updated_at   double precision NOT NULL
)

-- name: create_meta
CREATE TABLE IF NOT EXISTS {schema}.lease_celery_meta (
    name  text PRIMARY KEY,
    value text NOT NULL
)

-- name: get_schema_version
SELECT value FROM {schema}.lease_celery_meta WHERE name = 'schema_version'

-- name: set_schema_version
INSERT INTO {schema}.lease_celery_meta (name, value) VALUES ('schema_version', %(version)s)
ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value

-- name: now
SELECT COALESCE(%(now)s::double precision,
                extract(epoch FROM clock_timestamp())::double precision)

-- The fencing predicates (expires_at against now) read the clock in the WHERE clause itself,
-- not from a value taken when the statement started: a statement that waited for a row lock
-- re-checks the row after the wait, and must then judge it at that later instant.

-- name: fragment_claim_takes_the_row
-- Not a query: what a claim's upsert sets on the row it takes (a new token, one attempt more,
-- a takeover counted, the delivery's task info), written once for the plain claim and the
-- limited claim's function (queries.load_queries puts it in where {fragment_...} stands).
state      = 'running',
owner      = EXCLUDED.owner,
token      = l.token + 1,
expires_at = EXCLUDED.expires_at,
attempts   = CASE WHEN l.state = 'purged' THEN 1 ELSE l.attempts + 1 END,
takeovers  = CASE WHEN l.state = 'running' THEN l.takeovers + 1
                  WHEN l.state = 'purged' THEN 0 ELSE l.takeovers END,
not_before = NULL,
result     = NULL,
updated_at = EXCLUDED.updated_at,
fence      = EXCLUDED.fence,
task       = EXCLUDED.task,  -- this delivery's, or none: never a previous one's
nonce      = EXCLUDED.nonce,
settling   = false,
sweep_at   = EXCLUDED.sweep_at,
swept_by   = NULL,

-- name: claim
-- One statement: a new key starts at token 1; a conflicting row is locked and re-checked in its
-- latest version, and taken only when purged, ready and past its backoff, or running with an
-- expired lease (expires_at <= now: a takeover). Purge never deletes a row (it leaves a
-- tombstone), so a claim can never miss a purged key's token: under READ COMMITTED a claim that
-- waited on a concurrent DELETE would insert with a token read from a stale snapshot.
WITH clock AS (
    SELECT COALESCE(%(now)s::double precision,
                    extract(epoch FROM clock_timestamp())::double precision) AS now
)
INSERT INTO {schema}.lease_celery_leases AS l
       (key, state, owner, token, expires_at, attempts, takeovers, result, updated_at, fence,
        task, nonce, sweep_at, grp, slot)
SELECT %(key)s, 'running', %(owner)s, 1, clock.now + %(ttl)s, 1, 0, NULL, clock.now, nextval('{schema}.lease_celery_fence'),
       %(task)s, %(nonce)s, CASE WHEN %(task)s::text IS NULL THEN NULL ELSE clock.now + %(ttl)s END,
       NULL, NULL
FROM clock
ON CONFLICT (key) DO UPDATE SET
    {fragment_claim_takes_the_row}
    grp        = NULL,  -- a limited claim's group and slot (schema 6): this one has none
    slot       = NULL
WHERE l.state = 'purged'
   OR (l.state = 'ready' AND (l.not_before IS NULL OR l.not_before <= COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision)))
   OR (l.state = 'running' AND l.expires_at <= COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision))
RETURNING l.token, l.expires_at, l.fence, l.attempts, l.takeovers, l.cancel

-- name: record_published
-- A task is about to be published (lease_record_at_publish): its key's row, ready with the
-- message's task info, unless the key has one (a purged key's tombstone is taken over, its token
-- kept: the first claim continues above it). sweep_at is when it becomes claimable (the
-- message's countdown): the sweeper re-publishes it a grace period after that if nobody claimed
-- it. No history event: the claim writes the first one.
WITH clock AS (
    SELECT COALESCE(%(now)s::double precision,
                    extract(epoch FROM clock_timestamp())::double precision) AS now
)
INSERT INTO {schema}.lease_celery_leases AS l
       (key, state, owner, token, expires_at, attempts, takeovers, updated_at, task, sweep_at)
SELECT %(key)s, 'ready', NULL, 0, NULL, 0, 0, clock.now, %(task)s, clock.now + %(countdown)s
FROM clock
ON CONFLICT (key) DO UPDATE SET
    state = 'ready', owner = NULL, expires_at = NULL, attempts = 0, takeovers = 0, fence = 0,
    nonce = NULL, not_before = NULL, reason = NULL, result = NULL, checkpoint = NULL,
    cancel = NULL, settling = false, swept_by = NULL, swept_token = NULL,
    updated_at = EXCLUDED.updated_at, task = EXCLUDED.task, sweep_at = EXCLUDED.sweep_at
WHERE l.state = 'purged'
RETURNING l.key

-- name: published_already
-- After a re-sent record_published: is the row the one the first send wrote?
SELECT key FROM {schema}.lease_celery_leases
WHERE key = %(key)s AND state = 'ready' AND attempts = 0 AND task = %(task)s

-- name: claimed_by
-- After a refused claim: did this very claim call (its nonce) win, its reply lost and the
-- statement re-sent? Then the row carries the nonce.
SELECT token, expires_at, fence, attempts, takeovers, cancel
FROM {schema}.lease_celery_leases
WHERE key = %(key)s AND state = 'running' AND owner = %(owner)s AND nonce = %(nonce)s

-- name: renew_many
-- Each (key, owner, token) is renewed only while running (or settling), its own, and not
-- expired.
WITH clock AS (
    SELECT COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision) AS now
)
UPDATE {schema}.lease_celery_leases AS l
SET expires_at = clock.now + %(ttl)s, updated_at = clock.now,
    sweep_at = CASE WHEN l.task IS NULL THEN NULL ELSE clock.now + %(ttl)s END
FROM clock, unnest(%(keys)s::text[], %(owners)s::text[], %(tokens)s::bigint[])
     AS c(key, owner, token)
WHERE l.key = c.key AND (l.state = 'running' OR l.settling) AND l.owner = c.owner
  AND l.token = c.token
  AND l.expires_at > COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision)
RETURNING l.key, l.owner, l.token, l.expires_at, l.cancel

-- name: finish
-- %(settle_within)s NULL: settled at once; else done and settling until the owner confirms
-- (settle_many) or the settle deadline passes.
WITH clock AS (
    SELECT COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision) AS now
)
UPDATE {schema}.lease_celery_leases AS l
SET state = 'done', result = %(result)s, updated_at = clock.now, reason = NULL,
    checkpoint = NULL, cancel = NULL,
    settling   = %(settle_within)s::double precision IS NOT NULL,
    expires_at = clock.now + COALESCE(%(settle_within)s::double precision, 0),
    sweep_at   = CASE WHEN %(settle_within)s::double precision IS NULL OR l.task IS NULL
                      THEN NULL ELSE clock.now + %(settle_within)s::double precision END,
    -- settled at once: keep only the task id and context (lease_celery.execution.answers)
    task       = CASE WHEN %(settle_within)s::double precision IS NULL AND l.task IS NOT NULL
                      THEN jsonb_strip_nulls(jsonb_build_object('options', jsonb_build_object('task_id', l.task::jsonb #>> '{options,task_id}'), 'context', l.task::jsonb -> 'context'))::text ELSE l.task END
FROM clock
WHERE l.key = %(key)s AND l.state = 'running' AND l.owner = %(owner)s AND l.token = %(token)s
  AND l.expires_at > COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision)
RETURNING l.token

-- name: settle_many
-- The owners confirm that Celery stored the outcomes: the settle phases end, and a settled
-- done row no longer needs its task info.
WITH clock AS (SELECT COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision) AS now)
UPDATE {schema}.lease_celery_leases AS l
SET settling = false, sweep_at = NULL, updated_at = clock.now,
    -- a settled done row keeps only its task id and context (lease_celery.execution.answers)
    task = CASE WHEN l.state = 'done' AND l.task IS NOT NULL THEN jsonb_strip_nulls(jsonb_build_object('options', jsonb_build_object('task_id', l.task::jsonb #>> '{options,task_id}'), 'context', l.task::jsonb -> 'context'))::text ELSE l.task END
FROM clock, unnest(%(keys)s::text[], %(owners)s::text[], %(tokens)s::bigint[])
     AS c(key, owner, token)
WHERE l.key = c.key AND l.settling AND l.owner = c.owner AND l.token = c.token
RETURNING l.key, l.owner, l.token

-- name: settled_by_owner
-- After a re-sent settle_many: the rows these owners already settled (a settled row keeps the
-- owner and token that settled it).
SELECT l.key, l.owner, l.token FROM {schema}.lease_celery_leases AS l,
       unnest(%(keys)s::text[], %(owners)s::text[], %(tokens)s::bigint[]) AS c(key, owner, token)
WHERE l.key = c.key AND NOT l.settling AND l.state IN ('done', 'dead')
  AND l.owner = c.owner AND l.token = c.token

-- name: claim_settlement
-- A finished key whose owner neither confirmed nor renewed the settle phase before its
-- deadline is gone: this delivery completes it (same token; the owner becomes the completer).
WITH clock AS (SELECT COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision) AS now)
UPDATE {schema}.lease_celery_leases AS l
SET owner = %(owner)s, expires_at = clock.now + %(ttl)s, updated_at = clock.now,
    sweep_at = CASE WHEN l.task IS NULL THEN NULL ELSE clock.now + %(ttl)s END,
    swept_by = NULL, nonce = %(nonce)s
FROM clock
WHERE l.key = %(key)s AND l.settling AND l.expires_at <= COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision)
RETURNING l.token, l.expires_at, l.fence, l.attempts, l.takeovers

-- name: settlement_claimed_by
-- After a refused claim_settlement: did this very call (its nonce) win before its reply was
-- lost?
SELECT token, expires_at, fence, attempts, takeovers
FROM {schema}.lease_celery_leases
WHERE key = %(key)s AND settling AND owner = %(owner)s AND nonce = %(nonce)s

-- name: release
-- Give back early; %(delay)s > 0 sets the backoff before the next claim (or when a retry is
-- due). %(task)s (or NULL: kept) is the message that claims it next; %(given_back)s = 1 takes
-- this claim's attempt back. The sweeper re-publishes the row if nobody claimed it a grace
-- period after it became claimable.
WITH clock AS (
    SELECT COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision) AS now
)
UPDATE {schema}.lease_celery_leases AS l
SET state = 'ready', expires_at = clock.now, updated_at = clock.now, reason = %(reason)s,
    not_before = CASE WHEN %(delay)s::double precision > 0
                      THEN clock.now + %(delay)s::double precision END,
    task = COALESCE(%(task)s::text, l.task),
    attempts = l.attempts - %(given_back)s::integer,
    sweep_at = CASE WHEN COALESCE(%(task)s::text, l.task) IS NULL THEN NULL
                    ELSE clock.now + GREATEST(%(delay)s::double precision, 0) END,
    swept_by = NULL
FROM clock
WHERE l.key = %(key)s AND l.state = 'running' AND l.owner = %(owner)s AND l.token = %(token)s
  AND l.expires_at > COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision)
RETURNING l.token

-- name: kill
-- The current holder gives up for good: dead until a person requeues it. The task info stays
-- (requeue re-publishes it); with %(settle_within)s the owner settles the failure like a finish.
-- %(error)s, the exception as Celery stores it, is the outcome a duplicate is answered with.
WITH clock AS (SELECT COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision) AS now)
UPDATE {schema}.lease_celery_leases AS l
SET state = 'dead', updated_at = clock.now, reason = %(reason)s, result = %(error)s,
    settling   = %(settle_within)s::double precision IS NOT NULL,
    expires_at = clock.now + COALESCE(%(settle_within)s::double precision, 0),
    sweep_at   = CASE WHEN %(settle_within)s::double precision IS NULL OR l.task IS NULL
                      THEN NULL ELSE clock.now + %(settle_within)s::double precision END
FROM clock
WHERE l.key = %(key)s AND l.state = 'running' AND l.owner = %(owner)s AND l.token = %(token)s
  AND l.expires_at > COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision)
RETURNING l.token

-- name: force_release
-- An operator's override: a running row becomes ready whoever holds it. The holder's renew and
-- finish then fail (state is no longer running), so its result is refused.
WITH clock AS (SELECT COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision) AS now)
UPDATE {schema}.lease_celery_leases AS l
SET state = 'ready', expires_at = clock.now, updated_at = clock.now, not_before = NULL,
    reason = %(reason)s, swept_by = NULL,
    sweep_at = CASE WHEN l.task IS NULL THEN NULL ELSE clock.now END
FROM clock
WHERE l.key = %(key)s AND l.state = 'running'
RETURNING l.token

-- name: requeue
-- dead -> ready with a fresh budget of attempts; the token continues.
WITH clock AS (SELECT COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision) AS now)
UPDATE {schema}.lease_celery_leases AS l
SET state = 'ready', attempts = 0, takeovers = 0, not_before = NULL, updated_at = clock.now,
    reason = %(reason)s, settling = false, swept_by = NULL, cancel = NULL,
    sweep_at = CASE WHEN l.task IS NULL THEN NULL ELSE clock.now END
FROM clock
WHERE l.key = %(key)s AND l.state = 'dead'
RETURNING l.token

-- name: sweep
-- Mark and return the rows the sweeper may act on, read through the partial index on sweep_at:
-- a running lease or a settle phase past its deadline (its owner is gone), or a ready row
-- nobody claimed a grace period after it became claimable (its message was lost). SKIP LOCKED
-- lets concurrent sweepers split the rows; the mark moves sweep_at a grace period on, so each
-- row is returned once per grace period, and a sweeper that dies after marking leaves a mark
-- that expires. swept_by records this call, for a re-send to report exactly its own rows.
WITH clock AS (SELECT COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision) AS now),
candidates AS (
    SELECT l.key FROM {schema}.lease_celery_leases AS l, clock
    WHERE l.sweep_at IS NOT NULL AND l.sweep_at <= clock.now
      AND (((l.state = 'running' OR l.settling) AND l.expires_at <= clock.now)
           OR (l.state = 'ready' AND l.sweep_at <= clock.now - %(grace)s::double precision))
    ORDER BY l.sweep_at LIMIT %(limit)s
    FOR UPDATE OF l SKIP LOCKED
)
-- The candidates are looked up by key (= ANY of an array: one primary-key probe each). A join
-- let the planner, with statistics of a table of mostly done rows, scan the whole sweep index
-- once per candidate while holding the candidates' row locks.
UPDATE {schema}.lease_celery_leases AS l
SET sweep_at = CASE WHEN l.state = 'ready' THEN clock.now
                    ELSE clock.now + %(grace)s::double precision END,
    swept_by = %(nonce)s
FROM clock
WHERE l.key = ANY(ARRAY(SELECT key FROM candidates))
  AND l.sweep_at IS NOT NULL AND l.sweep_at <= clock.now
  AND (((l.state = 'running' OR l.settling) AND l.expires_at <= clock.now)
           OR (l.state = 'ready' AND l.sweep_at <= clock.now - %(grace)s::double precision))
RETURNING l.key

-- name: swept_already
-- After a re-sent sweep (the first send's reply was lost, its marks committed): the rows that
-- very call marked, and no other sweep's. Re-publishing one twice is harmless; never
-- re-publishing is not.
SELECT l.key FROM {schema}.lease_celery_leases AS l
WHERE l.swept_by = %(nonce)s
ORDER BY l.sweep_at LIMIT %(limit)s

-- name: sweep_unmark
-- The re-publish failed: let the next sweep try this row again (as due as before the mark).
UPDATE {schema}.lease_celery_leases
SET sweep_at = CASE WHEN state = 'ready' THEN COALESCE(not_before, 0) ELSE expires_at END,
    swept_by = NULL
WHERE key = %(key)s AND token = %(token)s AND swept_by IS NOT NULL AND sweep_at IS NOT NULL
RETURNING key

-- name: list_arm
-- find(): the rows of one index, newest first. {where} is a literal predicate on state
-- (lease_celery.stores.sql_glue.FIND_ARMS, never user data): with a literal the planner can
-- prove the partial index's own predicate in every plan, generic ones included. A tombstone
-- ('purged') is in no arm.
SELECT key, state, owner, token, expires_at, attempts, result, updated_at, fence, takeovers,
       not_before, reason, task, settling, checkpoint, cancel
FROM {schema}.lease_celery_leases
WHERE {where}
  AND (%(prefix)s::text IS NULL OR left(key, length(%(prefix)s::text)) = %(prefix)s::text)
  AND (%(owner)s::text IS NULL OR owner = %(owner)s::text
       OR left(owner, length(%(owner)s::text) + 1) = %(owner)s::text || '/')
ORDER BY updated_at DESC
LIMIT %(limit)s

-- name: list_merge
-- find() without a state: the newest of each index's newest (the arms above, one per {arm}).
SELECT * FROM ({ready}) AS ready UNION ALL SELECT * FROM ({running}) AS running
UNION ALL SELECT * FROM ({settled}) AS settled
ORDER BY updated_at DESC
LIMIT %(limit)s

-- name: stats
SELECT state, count(*) AS total,
       count(*) FILTER (WHERE state = 'running' AND expires_at <= COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision)) AS expired
FROM {schema}.lease_celery_leases WHERE state <> 'purged' GROUP BY state

-- name: purge_old
-- Tombstone the oldest settled done/dead rows (at most %(limit)s; NULL for all): only key and
-- token remain, so tokens never restart. Read through the partial index on terminal rows.
WITH clock AS (SELECT COALESCE(%(now)s::double precision,
                               extract(epoch FROM clock_timestamp())::double precision) AS now),
old AS (
    SELECT l.key FROM {schema}.lease_celery_leases AS l, clock
    WHERE l.state IN ('done', 'dead') AND NOT l.settling
      AND l.updated_at < clock.now - %(seconds)s
    ORDER BY l.updated_at LIMIT %(limit)s
    FOR UPDATE OF l SKIP LOCKED
)
UPDATE {schema}.lease_celery_leases AS l
SET state = 'purged', owner = NULL, result = NULL, task = NULL, reason = NULL,
    checkpoint = NULL, cancel = NULL,
    not_before = NULL, swept_token = NULL, settling = false, sweep_at = NULL, swept_by = NULL,
    updated_at = clock.now
FROM clock, old
WHERE l.key = old.key
RETURNING l.key

-- name: lock_current
-- The fencing predicate under a row lock, for store.fenced(): no claim can take the row over
-- until the caller's transaction ends.
SELECT l.token
FROM {schema}.lease_celery_leases AS l
WHERE l.key = %(key)s AND l.state = 'running' AND l.owner = %(owner)s AND l.token = %(token)s
  AND l.expires_at > COALESCE(%(now)s::double precision,
                              extract(epoch FROM clock_timestamp())::double precision)
FOR UPDATE

-- name: checkpoint
-- Fenced like finish: only the current holder's progress is written.
UPDATE {schema}.lease_celery_leases AS l SET checkpoint = %(checkpoint)s
WHERE l.key = %(key)s AND l.state = 'running' AND l.owner = %(owner)s AND l.token = %(token)s
  AND l.expires_at > COALESCE(%(now)s::double precision,
                              extract(epoch FROM clock_timestamp())::double precision)
RETURNING l.token

-- name: cancel
-- One statement. A live holder is asked to stop (its next renewal returns the reason); a key
-- nobody holds (no row, ready, an expired lease, a purge tombstone) goes dead at once, keeping
-- its token. Done and dead keys are left alone (nothing returned).
WITH clock AS (SELECT COALESCE(%(now)s::double precision,
                               extract(epoch FROM clock_timestamp())::double precision) AS now)
INSERT INTO {schema}.lease_celery_leases AS l
       (key, state, owner, token, expires_at, attempts, takeovers, reason, updated_at, cancel)
SELECT %(key)s, 'dead', NULL, 0, clock.now, 0, 0, %(reason)s, clock.now, %(reason)s FROM clock
ON CONFLICT (key) DO UPDATE SET
    state      = CASE WHEN l.state = 'running' AND l.expires_at > EXCLUDED.updated_at
                      THEN 'running' ELSE 'dead' END,
    reason     = CASE WHEN l.state = 'running' AND l.expires_at > EXCLUDED.updated_at
                      THEN l.reason ELSE EXCLUDED.reason END,
    owner      = CASE WHEN l.state = 'purged' THEN NULL ELSE l.owner END,
    attempts   = CASE WHEN l.state = 'purged' THEN 0 ELSE l.attempts END,
    expires_at = CASE WHEN l.state = 'running' AND l.expires_at > EXCLUDED.updated_at
                      THEN l.expires_at ELSE EXCLUDED.updated_at END,
    updated_at = EXCLUDED.updated_at,
    not_before = NULL,
    sweep_at   = CASE WHEN l.state = 'running' AND l.expires_at > EXCLUDED.updated_at
                      THEN l.sweep_at ELSE NULL END,
    swept_by   = CASE WHEN l.state = 'running' AND l.expires_at > EXCLUDED.updated_at
                      THEN l.swept_by ELSE NULL END,
    cancel     = EXCLUDED.cancel
WHERE l.state IN ('running', 'ready', 'purged')
RETURNING l.state

-- name: get
SELECT key, state, owner, token, expires_at, attempts, result, updated_at, fence, takeovers,
       not_before, reason, task, settling, checkpoint, cancel
FROM {schema}.lease_celery_leases WHERE key = %(key)s AND state <> 'purged'

-- name: purge
-- Tombstone the row unless a live lease holds it: only key and token remain.
WITH clock AS (SELECT COALESCE(%(now)s::double precision,
                               extract(epoch FROM clock_timestamp())::double precision) AS now)
UPDATE {schema}.lease_celery_leases AS l
SET state = 'purged', owner = NULL, result = NULL, task = NULL, reason = NULL,
    checkpoint = NULL, cancel = NULL,
    not_before = NULL, swept_token = NULL, settling = false, sweep_at = NULL, swept_by = NULL,
    updated_at = clock.now
FROM clock
WHERE l.key = %(key)s AND l.state <> 'purged'
  AND (l.state <> 'running' OR l.expires_at <= clock.now)
RETURNING l.token

-- name: effect_insert
-- Only while the caller's lease (if any) is current: a stalled worker starts no new action.
INSERT INTO {schema}.lease_celery_effects
       (key, fingerprint, state, lease_key, lease_token, lease_owner, started_at, attempts,
        result, version, updated_at)
SELECT %(key)s, %(fingerprint)s, 'in_flight', %(lease_key)s, %(lease_token)s, %(lease_owner)s,
       clock.now, 1, NULL, 1, clock.now
FROM (SELECT COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision) AS now) AS clock
WHERE %(lease_key)s::text IS NULL
   OR EXISTS (SELECT 1 FROM {schema}.lease_celery_leases AS l
                 WHERE l.key = %(lease_key)s AND l.state = 'running'
                   AND l.owner = %(lease_owner)s AND l.token = %(lease_token)s
                   AND l.expires_at > clock.now)
ON CONFLICT (key) DO NOTHING
RETURNING key

-- name: effect_get
SELECT key, fingerprint, state, lease_key, lease_token, lease_owner, started_at, attempts,
       result, version, updated_at
FROM {schema}.lease_celery_effects WHERE key = %(key)s

-- name: effect_find
-- Operators' listing of one state (the reconciliation queue), newest first: a range of the
-- state index read backwards. A statement of its own, apart from effect_find_any: planned
-- without the parameter's value (a prepared statement's generic plan), one statement for both,
-- "the parameter IS NULL OR state = the parameter", reads the whole table.
SELECT key, fingerprint, state, lease_key, lease_token, lease_owner, started_at, attempts,
       result, version, updated_at
FROM {schema}.lease_celery_effects WHERE state = %(state)s::text
ORDER BY updated_at DESC LIMIT %(limit)s

-- name: effect_find_any
-- Receipts of every state, newest first.
SELECT key, fingerprint, state, lease_key, lease_token, lease_owner, started_at, attempts,
       result, version, updated_at
FROM {schema}.lease_celery_effects
ORDER BY updated_at DESC LIMIT %(limit)s

-- name: effect_update
UPDATE {schema}.lease_celery_effects
SET state = %(state)s, result = %(result)s, version = version + 1,
    updated_at = COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision)
WHERE key = %(key)s AND version = %(version)s
RETURNING key

-- name: effect_restart
UPDATE {schema}.lease_celery_effects AS e
SET state = 'in_flight', lease_key = %(lease_key)s, lease_token = %(lease_token)s,
    lease_owner = %(lease_owner)s, started_at = clock.now, attempts = e.attempts + 1,
    version = e.version + 1, updated_at = clock.now
FROM (SELECT COALESCE(%(now)s::double precision, extract(epoch FROM clock_timestamp())::double precision) AS now) AS clock
WHERE e.key = %(key)s AND e.version = %(version)s
  AND (%(lease_key)s::text IS NULL
       OR EXISTS (SELECT 1 FROM {schema}.lease_celery_leases AS l
                 WHERE l.key = %(lease_key)s AND l.state = 'running'
                   AND l.owner = %(lease_owner)s AND l.token = %(lease_token)s
                   AND l.expires_at > clock.now))
RETURNING e.key

-- name: is_current
SELECT 1 FROM {schema}.lease_celery_leases AS l
WHERE l.key = %(key)s AND l.state = 'running' AND l.owner = %(owner)s AND l.token = %(token)s
  AND l.expires_at > COALESCE(%(now)s::double precision,
                              extract(epoch FROM clock_timestamp())::double precision)

-- name: effect_delete
DELETE FROM {schema}.lease_celery_effects WHERE key = %(key)s AND version = %(version)s
RETURNING key
