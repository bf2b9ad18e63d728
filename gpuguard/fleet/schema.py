"""The fleet's PostgreSQL schema: ordered migrations, safe for rolling upgrades.

Every migration is additive (new tables, columns with defaults, new functions under a new
name: heartbeat_v2 beside heartbeat_v1), so a node of the previous version keeps working
against a database a newer node has migrated. A migration that would break older nodes
says so in `min_node`: the oldest node schema version that can still use the database once
it is applied; a node older than that refuses to join with a clear message instead of
writing what it no longer understands. Migrations run in one transaction under an advisory
lock, so nodes starting together apply each exactly once.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpuguard.core.errors import GpuguardError

NAMESPACE = "gpuguard"
LOCK_KEY = 0x67707567  # pg_advisory_xact_lock key of the migrations ("gpug")


class FleetError(GpuguardError):
    """The fleet database cannot be used by this node (too old, unreachable at start, bad schema)."""


@dataclass(frozen=True)
class Migration:
    version: int
    min_node: int  # the oldest node schema version that still works once this is applied
    sql: str


# What a node's own role may write (migration 7): grants on one GPU, at most those it may share it
# among (gpuguard.core.policy.FRACTIONS_PER_GPU, which a released migration copies: never edited);
# how far a node's clock may run ahead of the database's for its ledger rows.
GRANTS_PER_GPU = 48
SKEW = 300.0
TIME_MAX = 1e11  # seconds: the largest epoch time (the year 5138) or duration a row may hold
# What one node's rows may make every node read (migration 9): a text a node writes (an ssh line,
# a GPU's name, a user name) is at most TEXT_MAX characters, and a heartbeat lists at most
# GPUS_PER_NODE GPUs (16 GPUs in MIG mode, 7 slices each, are 128 units).
TEXT_MAX = 255
GPUS_PER_NODE = 512


# A heartbeat that says where the database has what the node last sent (its digest, `since`):
# the node seen now, and the new digest; writes_for's check in the statement (a caller it would
# refuse is asked to resend, and refused then), as is the digest's (none: asked to resend).
_SEEN = """            UPDATE gpuguard.nodes n SET last_seen = at, digest = doc->>'digest'
                WHERE n.name = me AND n.digest = doc->>'since' AND (
                    session_user = 'gpuguard_node_' || me OR pg_has_role(session_user, (
                        SELECT nspowner FROM pg_namespace WHERE nspname = 'gpuguard'), 'USAGE'))
                RETURNING n.clash, n.lease + n.grace INTO clash, clash_for;
            IF NOT FOUND THEN
                RETURN jsonb_build_object('at', at, 'resend', true);
            END IF;
"""
# What a heartbeat answers (heartbeat_v5, and heartbeat_v6's short way): the usage elsewhere of
# the users it waits for, their grants elsewhere, where GPUs are free, a clash on its name; and
# when asked, every user's usage elsewhere (`gpuguard fairshare`).
_ANSWERS = """            answer := jsonb_build_object('at', at, 'free', '[]'::jsonb, 'held', '{}'::jsonb, 'usage', '{}'::jsonb);
            IF jsonb_array_length(doc->'usage_for') > 0 THEN
                answer := answer || jsonb_build_object('usage', gpuguard.usage_elsewhere(
                    ARRAY(SELECT jsonb_array_elements_text(doc->'usage_for')), me, at, half));
            END IF;
            IF jsonb_array_length(doc->'users') > 0 THEN
                answer := answer || jsonb_build_object('held', (SELECT coalesce(jsonb_object_agg(w.name, (
                    SELECT count(*) FROM gpuguard.grants g WHERE g.username = w.name AND g.node <> me AND (
                        SELECT gpuguard.counts(o, at) FROM gpuguard.nodes o WHERE o.name = g.node))), '{}')
                    FROM jsonb_array_elements_text(doc->'users') AS w(name)));
            END IF;
            IF (doc->>'want_free')::boolean THEN
                answer := answer || jsonb_build_object('free', (SELECT coalesce(jsonb_agg(f), '[]') FROM (
                    SELECT o.name AS node, o.rack, o.ssh, count(*) AS free
                    FROM gpuguard.gpus g JOIN gpuguard.nodes o ON o.name = g.node
                    WHERE g.owner = 'gpuguard' AND o.name <> me AND o.last_seen >= at - o.lease
                      AND NOT EXISTS (SELECT 1 FROM gpuguard.grants r WHERE r.node = g.node AND r.minor = g.minor)
                    GROUP BY o.name, o.rack, o.ssh ORDER BY count(*) DESC, o.name LIMIT 5) f));
            END IF;
            IF clash IS NOT NULL AND at - (clash->>'at')::double precision <= clash_for THEN
                answer := answer || jsonb_build_object('clash', clash);  -- another install tried this name lately
            END IF;
"""
_USAGE_ALL = """        IF coalesce((doc->>'usage_all')::boolean, false) AND NOT answer ? 'refused' THEN
            answer := answer || jsonb_build_object('usage_all', gpuguard.usage_elsewhere(ARRAY(
                SELECT l.username FROM gpuguard.ledger l WHERE l.ended >= at - 30 * half AND l.node <> me
                UNION SELECT g.username FROM gpuguard.grants g WHERE g.node <> me), me, at, half));
        END IF;
"""


def _times(*columns: str) -> str:
    """SQL: every column a number from 0 to TIME_MAX (BETWEEN is false for NaN and the infinities)."""
    return " AND ".join(f"{column} BETWEEN 0 AND {TIME_MAX:.0f}" for column in columns)


def _short(*columns: str) -> str:
    """SQL: every text column at most TEXT_MAX characters (a NULL passes, as in any CHECK)."""
    return " AND ".join(f"length({column}) <= {TEXT_MAX}" for column in columns)


# The texts a node writes, by table (migration 9 bounds them).
_TEXTS = {"nodes": ("rack", "ssh", "version", "incarnation", "host", "identity", "digest"),
          "gpus": ("uuid", "name", "owner"), "grants": ("username", "origin"), "queue": ("username",),
          "ledger": ("incarnation", "username")}


def _texts_bounded() -> str:
    """SQL of migration 9: the rows with a text past TEXT_MAX taken out, then each table's CHECK."""
    return "".join([f"    DELETE FROM gpuguard.{table} WHERE NOT ({_short(*columns)});\n"
                    for table, columns in _TEXTS.items()] +
                   [f"    ALTER TABLE gpuguard.{table} ADD CONSTRAINT {table}_texts CHECK ({_short(*columns)});\n"
                    for table, columns in _TEXTS.items()])


def _heartbeat_v1(create: str, decay: Callable[[str], str]) -> str:
    """heartbeat_v1 as a migration creates it: `decay(elapsed)` is the SQL of 0.5 ** (elapsed /
    half), the weight of usage `elapsed` seconds ago. Migration 1 made it with power(), which
    raises an underflow past about 1,074 half-lives (a grant started while a node's clock said
    1970); migration 3 makes it again with gpuguard.decay, which cannot."""
    return _HEARTBEAT_V1.format(create=create, ended=decay("at - l.ended"), started=decay("at - l.started"),
                                granted=decay("at - g.granted_at"))


def _decay_as_released(elapsed: str) -> str:
    return f"power(0.5, greatest(0, {elapsed}) / half)"


# heartbeat_v1's statements for each part of the node's truth (heartbeat_v5 runs those that changed)
_GPUS = """        DELETE FROM gpuguard.gpus g WHERE g.node = me AND NOT EXISTS (
            SELECT 1 FROM jsonb_to_recordset(doc->'gpus') AS x(minor integer) WHERE x.minor = g.minor);
        -- unchanged rows are not touched (an upsert would lock each, writing to its page every beat)
        UPDATE gpuguard.gpus g SET uuid = x.uuid, name = x.name, memory_total = x.memory_total, owner = x.owner
            FROM jsonb_to_recordset(doc->'gpus') AS x(minor integer, uuid text, name text, memory_total bigint, owner text)
            WHERE g.node = me AND g.minor = x.minor
              AND (g.uuid, g.name, g.memory_total, g.owner) IS DISTINCT FROM (x.uuid, x.name, x.memory_total, x.owner);
        INSERT INTO gpuguard.gpus (node, minor, uuid, name, memory_total, owner)
            SELECT me, x.minor, x.uuid, x.name, x.memory_total, x.owner
            FROM jsonb_to_recordset(doc->'gpus') AS x(minor integer, uuid text, name text, memory_total bigint, owner text)
            WHERE NOT EXISTS (SELECT 1 FROM gpuguard.gpus g WHERE g.node = me AND g.minor = x.minor)
        ON CONFLICT DO NOTHING;

"""
_GRANTS = """        -- grants made after the snapshot was taken are not in it, and stay
        DELETE FROM gpuguard.grants g WHERE g.node = me AND g.granted_at < taken AND NOT EXISTS (
            SELECT 1 FROM jsonb_to_recordset(doc->'grants') AS x(minor integer, username text)
            WHERE x.minor = g.minor AND x.username = g.username);
        INSERT INTO gpuguard.grants (node, minor, username, uid, granted_at, expires_at, shared, origin)
            SELECT me, x.minor, x.username, x.uid, x.granted_at, x.expires_at, x.shared, x.origin
            FROM jsonb_to_recordset(doc->'grants') AS x(minor integer, username text, uid integer,
                 granted_at double precision, expires_at double precision, shared boolean, origin text)
        ON CONFLICT DO NOTHING;

"""
_QUEUE = """        DELETE FROM gpuguard.queue q WHERE q.node = me AND NOT EXISTS (
            SELECT 1 FROM jsonb_to_recordset(doc->'queue') AS x(ticket integer) WHERE x.ticket = q.ticket);
        INSERT INTO gpuguard.queue (node, ticket, username, gpus, since, priority)
            SELECT me, x.ticket, x.username, x.gpus, x.since, x.priority
            FROM jsonb_to_recordset(doc->'queue') AS x(ticket integer, username text, gpus integer,
                 since double precision, priority integer)
        ON CONFLICT DO NOTHING;

"""
_LEDGER = """        INSERT INTO gpuguard.ledger (node, incarnation, seq, username, minor, started, ended)
            SELECT me, doc->>'incarnation', x.seq, x.username, x.minor, x.started, x.ended
            FROM jsonb_to_recordset(doc->'ledger') AS x(seq bigint, username text, minor integer,
                 started double precision, ended double precision)
        ON CONFLICT DO NOTHING;

"""
_HEARTBEAT_V1 = """    -- One heartbeat, one round trip: the node's truth replaces its mirror, the ledger rows of
    -- its outbox are added (a replay adds nothing twice), and it gets back what it caches:
    -- the recent usage elsewhere of the users it asks about (fair share), their grants
    -- elsewhere (offline budget), and when it is full, where GPUs are free.
    {create} gpuguard.heartbeat_v1(doc jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
    DECLARE
        me text := doc->>'node';
        at double precision := extract(epoch FROM clock_timestamp());
        taken double precision := (doc->>'taken_at')::double precision;
        half double precision := (doc->>'half_life')::double precision;
        usage jsonb := '{{}}';
        held jsonb := '{{}}';
        free jsonb := '[]';
    BEGIN
        INSERT INTO gpuguard.nodes AS n (name, rack, ssh, version, schema_version, incarnation,
                                         heartbeat, lease, grace, first_seen, last_seen)
        VALUES (me, doc->>'rack', doc->>'ssh', doc->>'version', (doc->>'schema')::integer, doc->>'incarnation',
                (doc->>'heartbeat')::double precision, (doc->>'lease')::double precision,
                (doc->>'grace')::double precision, at, at)
        ON CONFLICT (name) DO UPDATE SET rack = excluded.rack, ssh = excluded.ssh, version = excluded.version,
            schema_version = excluded.schema_version, incarnation = excluded.incarnation,
            heartbeat = excluded.heartbeat, lease = excluded.lease, grace = excluded.grace,
            last_seen = excluded.last_seen;

""" + _GPUS + _GRANTS + _QUEUE + _LEDGER + """        IF jsonb_array_length(doc->'usage_for') > 0 THEN
            SELECT coalesce(jsonb_object_agg(u.name, u.value), '{{}}') INTO usage FROM (
                SELECT w.name, coalesce((
                    SELECT sum(half / ln(2) * ({ended}
                                               - {started}))
                    FROM gpuguard.ledger l  -- 30 half-lives back: what is older counts less than 1e-9
                    WHERE l.username = w.name AND l.ended >= at - 30 * half AND l.node <> me), 0)
                  + coalesce((
                    SELECT sum(half / ln(2) * (1 - {granted}))
                    FROM gpuguard.grants g WHERE g.username = w.name AND g.node <> me AND (
                        SELECT gpuguard.counts(n, at) FROM gpuguard.nodes n WHERE n.name = g.node)), 0) AS value
                FROM jsonb_array_elements_text(doc->'usage_for') AS w(name)) u;
        END IF;
        IF jsonb_array_length(doc->'users') > 0 THEN
            SELECT coalesce(jsonb_object_agg(w.name, (
                SELECT count(*) FROM gpuguard.grants g WHERE g.username = w.name AND g.node <> me AND (
                    SELECT gpuguard.counts(n, at) FROM gpuguard.nodes n WHERE n.name = g.node))), '{{}}') INTO held
            FROM jsonb_array_elements_text(doc->'users') AS w(name);
        END IF;
        IF (doc->>'want_free')::boolean THEN
            SELECT coalesce(jsonb_agg(f), '[]') INTO free FROM (
                SELECT n.name AS node, n.rack, n.ssh, count(*) AS free
                FROM gpuguard.gpus g JOIN gpuguard.nodes n ON n.name = g.node
                WHERE g.owner = 'gpuguard' AND n.name <> me AND n.last_seen >= at - n.lease
                  AND NOT EXISTS (SELECT 1 FROM gpuguard.grants r WHERE r.node = g.node AND r.minor = g.minor)
                GROUP BY n.name, n.rack, n.ssh ORDER BY count(*) DESC, n.name LIMIT 5) f;
        END IF;
        RETURN jsonb_build_object('at', at, 'usage', usage, 'held', held, 'free', free);
    END $$;
"""


def _checked(function: str, inner: str) -> str:
    """SQL: gpuguard.<function>(doc), the owner's, calling gpuguard.<inner>(doc) once writes_for
    says the caller may write as doc's node (migration 5)."""
    return f"""
    CREATE FUNCTION gpuguard.{function}(doc jsonb) RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER
        SET search_path = pg_catalog, pg_temp AS $$
    BEGIN
        PERFORM gpuguard.writes_for(doc->>'node');
        RETURN gpuguard.{inner}(doc);
    END $$;
"""


def _kept(part: str) -> str:
    """SQL of gpuguard.bounded: doc's `part` is what was kept, and what was not goes under `skipped`."""
    return f"""            doc := jsonb_set(doc, '{{{part}}}', kept);
            IF dropped IS NOT NULL THEN
                skipped := skipped || jsonb_build_object('{part}', dropped);
            END IF;
"""


def _bounded_checked(function: str, inner: str, ignored: str = "") -> str:
    """SQL: gpuguard.<function>(doc) made again (migration 7): writes_for's check, then
    gpuguard.<inner> on what gpuguard.bounded leaves of doc, its answer saying what was left out;
    `ignored`: an SQL operator taking out of doc what bounded must not read (migration 9)."""
    return f"""    CREATE OR REPLACE FUNCTION gpuguard.{function}(doc jsonb) RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER
        SET search_path = pg_catalog, pg_temp AS $$
    DECLARE
        kept jsonb;
    BEGIN
        PERFORM gpuguard.writes_for(doc->>'node');
        kept := gpuguard.bounded(doc{ignored});
        RETURN gpuguard.with_skipped(gpuguard.{inner}(kept - 'skipped'), kept);
    END $$;
"""


# Times are epoch seconds (double precision): last_seen and first_seen by the database's clock,
# so that nodes with skewed clocks agree on who is lost; grant and ledger times by the node's.
MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, 1, """
    CREATE TABLE gpuguard.nodes (
        name text PRIMARY KEY, rack text NOT NULL DEFAULT '', ssh text NOT NULL DEFAULT '',
        version text NOT NULL DEFAULT '', schema_version integer NOT NULL DEFAULT 0,
        incarnation text NOT NULL DEFAULT '',
        heartbeat double precision NOT NULL, lease double precision NOT NULL, grace double precision NOT NULL,
        first_seen double precision NOT NULL, last_seen double precision NOT NULL);
    -- owner: which system hands the GPU out (gpuguard, slurm, k8s)
    CREATE TABLE gpuguard.gpus (
        node text NOT NULL REFERENCES gpuguard.nodes ON DELETE CASCADE, minor integer NOT NULL,
        uuid text NOT NULL, name text NOT NULL, memory_total bigint NOT NULL,
        owner text NOT NULL DEFAULT 'gpuguard',
        PRIMARY KEY (node, minor));
    CREATE TABLE gpuguard.grants (
        node text NOT NULL REFERENCES gpuguard.nodes ON DELETE CASCADE, minor integer NOT NULL,
        username text NOT NULL, uid integer NOT NULL, granted_at double precision NOT NULL,
        expires_at double precision, shared boolean NOT NULL DEFAULT false, origin text NOT NULL,
        PRIMARY KEY (node, minor, username));
    -- no GPU is granted twice, whatever a node (or two nodes misconfigured with one name) sends
    CREATE UNIQUE INDEX grants_one_holder ON gpuguard.grants (node, minor) WHERE NOT shared;
    CREATE INDEX grants_by_user ON gpuguard.grants (username);
    -- one row per user: a grant-time check locks it, so a user's checks on all nodes run one at a time
    CREATE TABLE gpuguard.fleet_quotas (
        username text PRIMARY KEY, cluster_gpus integer, updated_at double precision NOT NULL);
    CREATE TABLE gpuguard.queue (
        node text NOT NULL REFERENCES gpuguard.nodes ON DELETE CASCADE, ticket integer NOT NULL,
        username text NOT NULL, gpus integer NOT NULL, since double precision NOT NULL,
        priority integer NOT NULL,
        PRIMARY KEY (node, ticket));
    -- the usage ledger: one row per ended grant, from each node's outbox (seq: the outbox's id;
    -- incarnation: a fresh state directory starts a new one), replayed without duplicates
    CREATE TABLE gpuguard.ledger (
        node text NOT NULL, incarnation text NOT NULL, seq bigint NOT NULL,
        username text NOT NULL, minor integer NOT NULL,
        started double precision NOT NULL, ended double precision NOT NULL,
        PRIMARY KEY (node, incarnation, seq));
    CREATE INDEX ledger_by_user ON gpuguard.ledger (username, ended);

    -- A node's grants count against fleet quotas while it is seen, and for `grace` after its lease.
    -- Asked as a scalar subquery per grant row: an index probe each (an EXISTS or a join is
    -- planned as a hash over every node, which made a heartbeat cost grow with the fleet).
    CREATE FUNCTION gpuguard.counts(n gpuguard.nodes, at double precision) RETURNS boolean
        LANGUAGE sql IMMUTABLE AS $$ SELECT n.last_seen >= at - n.lease - n.grace $$;

""" + _heartbeat_v1("CREATE FUNCTION", _decay_as_released) + """
    -- The grant-time check, one transaction: lock the user's quota row (taken by the upsert),
    -- count their grants on every node that counts, insert what fits. Concurrent checks for
    -- one user, from any node, wait on that row; the unique index refuses a GPU granted twice.
    CREATE FUNCTION gpuguard.reserve_v1(doc jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
    DECLARE
        me text := doc->>'node';
        who text := doc->>'user';
        quota integer := (doc->>'cluster_gpus')::integer;
        at double precision := extract(epoch FROM clock_timestamp());
        wanted integer[] := ARRAY(SELECT jsonb_array_elements_text(doc->'minors')::integer);
        held integer;
        took integer[];
    BEGIN
        INSERT INTO gpuguard.fleet_quotas AS q (username, cluster_gpus, updated_at) VALUES (who, quota, at)
        ON CONFLICT (username) DO UPDATE SET cluster_gpus = excluded.cluster_gpus, updated_at = excluded.updated_at;
        SELECT count(*) INTO held FROM gpuguard.grants g WHERE g.username = who AND (g.node = me OR (
            SELECT gpuguard.counts(n, at) FROM gpuguard.nodes n WHERE n.name = g.node));
        took := CASE WHEN quota IS NULL THEN wanted ELSE wanted[1:greatest(0, quota - held)] END;
        INSERT INTO gpuguard.grants (node, minor, username, uid, granted_at, expires_at, shared, origin)
            SELECT me, m, who, (doc->>'uid')::integer, (doc->>'granted_at')::double precision,
                   (doc->>'expires_at')::double precision, (doc->>'shared')::boolean, doc->>'origin'
            FROM unnest(took) AS m;
        RETURN jsonb_build_object('granted', to_jsonb(took), 'held', held, 'quota', quota);
    END $$;
    """),
    # A node's place in its queue may change its GPU count in place (gpuguard.services.queueing's
    # keep_total: a GPU it counted on was taken back by a rule), where heartbeat_v1 keeps a
    # ticket's first count: v2 is v1, then the counts of the tickets it kept brought up to date.
    Migration(2, 1, """
    CREATE FUNCTION gpuguard.heartbeat_v2(doc jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
    DECLARE
        answer jsonb := gpuguard.heartbeat_v1(doc);
    BEGIN
        UPDATE gpuguard.queue q SET gpus = x.gpus
            FROM jsonb_to_recordset(doc->'queue') AS x(ticket integer, gpus integer)
            WHERE q.node = doc->>'node' AND q.ticket = x.ticket AND q.gpus <> x.gpus;
        RETURN answer;
    END $$;
    """),
    # Bad rows are data, never a crash. heartbeat_v1 again, its decay computed by gpuguard.decay,
    # which stops at 1,000 half-lives (power() raised an underflow past about 1,074: one ledger
    # row from a node whose clock said 1970 made every heartbeat of the node where its user waits
    # fail). Every time and duration must then be a number between 0 and TIME_MAX (no NaN, no
    # infinity): rows that are not are taken out first (a node's own come back with its next
    # heartbeat, a node row included; a bad ledger row would only count wrongly), then the CHECKs
    # refuse such rows for good.
    Migration(3, 1, """
    CREATE FUNCTION gpuguard.decay(elapsed double precision, half double precision) RETURNS double precision
        LANGUAGE sql IMMUTABLE AS $$ SELECT power(0.5, least(1000, greatest(0, elapsed) / half)) $$;
    """ + _heartbeat_v1("CREATE OR REPLACE FUNCTION", lambda elapsed: f"gpuguard.decay({elapsed}, half)") + f"""
    DELETE FROM gpuguard.nodes WHERE NOT ({_times("first_seen", "last_seen", "heartbeat", "lease", "grace")});
    DELETE FROM gpuguard.grants WHERE NOT ({_times("granted_at")} AND coalesce(expires_at BETWEEN 0 AND {TIME_MAX:.0f}, true));
    DELETE FROM gpuguard.queue WHERE NOT ({_times("since")});
    DELETE FROM gpuguard.ledger WHERE NOT ({_times("started", "ended")});
    DELETE FROM gpuguard.fleet_quotas WHERE NOT ({_times("updated_at")});
    ALTER TABLE gpuguard.nodes ADD CONSTRAINT nodes_times
        CHECK ({_times("first_seen", "last_seen", "heartbeat", "lease", "grace")});
    ALTER TABLE gpuguard.grants ADD CONSTRAINT grants_times
        CHECK ({_times("granted_at")} AND (expires_at IS NULL OR expires_at BETWEEN 0 AND {TIME_MAX:.0f}));
    ALTER TABLE gpuguard.queue ADD CONSTRAINT queue_times CHECK ({_times("since")});
    ALTER TABLE gpuguard.ledger ADD CONSTRAINT ledger_times CHECK ({_times("started", "ended")});
    ALTER TABLE gpuguard.fleet_quotas ADD CONSTRAINT fleet_quotas_times CHECK ({_times("updated_at")});
    """),
    # Node names are unique (gpuguard.fleet.identity). Each node row records who wrote it: the
    # host name and the install (a hash of the machine-id and a key of the state directory). A
    # heartbeat or a grant-time check under a name that a live install of another holds is
    # refused, with nothing written but `clash` on the holder's row (so that it learns of it);
    # a holder silent past lease + grace (gpuguard.counts) is taken over. A row last written
    # by a node of schema 3 or older has no install: its outbox's incarnation says whose it is,
    # so an upgraded node keeps its own row and a node of an older release is still told apart.
    # Nodes of schema 3 go on calling heartbeat_v2 and reserve_v1, unchecked.
    Migration(4, 1, """
    ALTER TABLE gpuguard.nodes ADD COLUMN host text NOT NULL DEFAULT '',
        ADD COLUMN identity text NOT NULL DEFAULT '', ADD COLUMN clash jsonb;

    CREATE FUNCTION gpuguard.holds(n gpuguard.nodes, install text, incarnation text) RETURNS boolean
        LANGUAGE sql IMMUTABLE AS $$
        SELECT CASE WHEN n.schema_version >= 4 THEN n.identity = install ELSE n.incarnation = incarnation END $$;

    -- who holds the row, as a refusal names it (a node of an older release: its outbox only)
    CREATE FUNCTION gpuguard.holder(n gpuguard.nodes, at double precision) RETURNS jsonb
        LANGUAGE sql IMMUTABLE AS $$
        SELECT jsonb_build_object('host', CASE WHEN n.schema_version >= 4 THEN n.host ELSE '' END,
                                  'install', CASE WHEN n.schema_version >= 4 THEN n.identity ELSE n.incarnation END,
                                  'silent_for', at - n.last_seen) $$;

    CREATE FUNCTION gpuguard.heartbeat_v3(doc jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
    DECLARE
        me text := doc->>'node';
        my_host text := coalesce(doc->>'host', '');
        my_install text := coalesce(doc->>'install', '');  -- none: ''
        at double precision := extract(epoch FROM clock_timestamp());
        n gpuguard.nodes;
        lost jsonb;
        answer jsonb;
    BEGIN
        -- the row locked first, so that two installs starting under one new name are told apart too
        SELECT * INTO n FROM gpuguard.nodes WHERE name = me FOR UPDATE;
        IF NOT FOUND THEN
            INSERT INTO gpuguard.nodes (name, host, identity, schema_version, incarnation, heartbeat, lease, grace,
                                        first_seen, last_seen)
            VALUES (me, my_host, my_install, (doc->>'schema')::integer, doc->>'incarnation',
                    (doc->>'heartbeat')::double precision, (doc->>'lease')::double precision,
                    (doc->>'grace')::double precision, at, at)
            ON CONFLICT (name) DO NOTHING;
            SELECT * INTO n FROM gpuguard.nodes WHERE name = me FOR UPDATE;
        END IF;
        IF NOT gpuguard.holds(n, my_install, coalesce(doc->>'incarnation', '')) THEN
            IF gpuguard.counts(n, at) THEN
                UPDATE gpuguard.nodes SET clash = jsonb_build_object('host', my_host, 'install', my_install, 'at', at)
                    WHERE name = me;
                RETURN jsonb_build_object('at', at, 'refused', gpuguard.holder(n, at));
            END IF;
            lost := gpuguard.holder(n, at);  -- silent past lease + grace: the name is this install's now
        END IF;
        answer := gpuguard.heartbeat_v2(doc);
        IF lost IS NOT NULL OR (n.host, n.identity) IS DISTINCT FROM (my_host, my_install) THEN
            UPDATE gpuguard.nodes SET host = my_host, identity = my_install,
                                      clash = CASE WHEN lost IS NULL THEN clash END
                WHERE name = me;
        END IF;
        IF lost IS NOT NULL THEN
            RETURN answer || jsonb_build_object('took_over', lost);
        END IF;
        IF n.clash IS NOT NULL AND at - (n.clash->>'at')::double precision <= n.lease + n.grace THEN
            RETURN answer || jsonb_build_object('clash', n.clash);  -- another install tried this name lately
        END IF;
        RETURN answer;
    END $$;

    CREATE FUNCTION gpuguard.reserve_v2(doc jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
    DECLARE
        n gpuguard.nodes;
    BEGIN
        SELECT * INTO n FROM gpuguard.nodes WHERE name = doc->>'node';
        IF FOUND AND NOT gpuguard.holds(n, coalesce(doc->>'install', ''), coalesce(doc->>'incarnation', '')) THEN
            RETURN jsonb_build_object('refused', gpuguard.holder(n, extract(epoch FROM clock_timestamp())));
        END IF;
        RETURN gpuguard.reserve_v1(doc);
    END $$;
    """),
    # One role per node (gpuguard.fleet.roles, `gpuguard fleet init`): a node's login role writes
    # only its own rows. What a node writes goes through SECURITY DEFINER functions of the schema's
    # owner, which first check the caller (writes_for): the node's own role (gpuguard_node_ and
    # its name) or a member of the owner (the single role of a fleet set up before roles, which
    # may write anything, as it could); their search_path is pinned, so that nothing a caller
    # creates is found in their place. EXECUTE on every function of the schema is taken from
    # PUBLIC (PostgreSQL grants it by default), for those made later by the owner too; `gpuguard
    # fleet init` grants each role what it may call and read. Nodes of schema 4 go on calling
    # heartbeat_v3 and reserve_v2 under the owner's role (a node's role may not).
    Migration(5, 1, """
    CREATE FUNCTION gpuguard.writes_for(node text) RETURNS void LANGUAGE plpgsql STABLE
        SET search_path = pg_catalog, pg_temp AS $$
    BEGIN
        IF session_user = 'gpuguard_node_' || node
           OR pg_has_role(session_user, (SELECT nspowner FROM pg_namespace WHERE nspname = 'gpuguard'), 'USAGE') THEN
            RETURN;
        END IF;
        RAISE EXCEPTION 'role % may not write the rows of node %', session_user, coalesce(node, '(none)')
            USING ERRCODE = 'insufficient_privilege';
    END $$;
""" + _checked("heartbeat_v4", "heartbeat_v3") + _checked("reserve_v3", "reserve_v2") + """
    -- grants of node `of_node` taken back: (minors[i], users[i]) each
    CREATE FUNCTION gpuguard.release_v1(of_node text, minors integer[], users text[]) RETURNS void
        LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    BEGIN
        PERFORM gpuguard.writes_for(of_node);
        DELETE FROM gpuguard.grants g WHERE g.node = of_node AND (g.minor, g.username) IN (
            SELECT * FROM unnest(minors, users));
    END $$;

    REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA gpuguard FROM PUBLIC;
    ALTER DEFAULT PRIVILEGES IN SCHEMA gpuguard REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;
    """),
    # A heartbeat writes what changed (gpuguard.fleet.fleetdb.FleetDb.heartbeat). heartbeat_v5
    # without `since` is heartbeat_v4 (checked, then v3), which also stores the `digest` the node
    # sends of what it mirrors (its row's fields, GPUs, grants and queue), unless refused. With
    # `since`, the digest stored by the node's last heartbeat: where the row still has it (this
    # install's, since the digest covers the install), last_seen and the new digest are written,
    # and of the GPUs, grants and queue those the document has (the parts that changed) as v1
    # writes them; then the ledger rows and the answers, as before. Where it has not (the node
    # removed, another install), the answer is `resend` and the node sends everything. Only the
    # node writes its rows (migration 5); it sends its grants after its own grant-time check or
    # release, and everything on a new connection and once a minute. `usage_all` also answers
    # the usage elsewhere of every user who has any (`gpuguard fairshare`, at most once a minute).
    # Nodes of schema 5 go on calling heartbeat_v4, which leaves the digest alone: a node of
    # schema 6 sends everything first on each connection.
    Migration(6, 1, """
    ALTER TABLE gpuguard.nodes ADD COLUMN digest text;

    -- the heartbeat's usage elsewhere of the users named (decayed GPU-seconds; 0 for those with
    -- none), as heartbeat_v1 works it out; plpgsql, whose plans a connection keeps (a SQL function's
    -- are made again at each call)
    CREATE FUNCTION gpuguard.usage_elsewhere(names text[], me text, at double precision, half double precision)
        RETURNS jsonb LANGUAGE plpgsql STABLE AS $$
    BEGIN
        IF cardinality(names) = 0 THEN
            RETURN '{}';
        END IF;
        RETURN (SELECT coalesce(jsonb_object_agg(w.name, coalesce(u.value, 0)), '{}') FROM unnest(names) AS w(name)
            LEFT JOIN (
            SELECT x.username, sum(x.value) AS value FROM (
                SELECT l.username, half / ln(2) * (gpuguard.decay(at - l.ended, half)
                                                   - gpuguard.decay(at - l.started, half)) AS value
                FROM gpuguard.ledger l  -- 30 half-lives back: what is older counts less than 1e-9
                WHERE l.username = ANY (names) AND l.ended >= at - 30 * half AND l.node <> me
                UNION ALL
                SELECT g.username, half / ln(2) * (1 - gpuguard.decay(at - g.granted_at, half))
                FROM gpuguard.grants g WHERE g.username = ANY (names) AND g.node <> me AND (
                    SELECT gpuguard.counts(n, at) FROM gpuguard.nodes n WHERE n.name = g.node)) x
            GROUP BY x.username) u ON u.username = w.name);
    END $$;

    CREATE FUNCTION gpuguard.heartbeat_v5(doc jsonb) RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER
        SET search_path = pg_catalog, pg_temp AS $$
    DECLARE
        me text := doc->>'node';
        at double precision := extract(epoch FROM clock_timestamp());
        taken double precision := (doc->>'taken_at')::double precision;
        half double precision := (doc->>'half_life')::double precision;
        clash jsonb;
        clash_for double precision;  -- how long a clash is told (lease + grace)
        answer jsonb;
    BEGIN
        IF NOT doc ? 'since' THEN
            PERFORM gpuguard.writes_for(me);
            answer := gpuguard.heartbeat_v3(doc);
            IF NOT answer ? 'refused' THEN
                UPDATE gpuguard.nodes SET digest = doc->>'digest' WHERE name = me AND digest IS DISTINCT FROM doc->>'digest';
            END IF;
        ELSE
            -- writes_for's check, in the statement: a caller it would refuse is asked to resend, and refused then
""" + _SEEN + """            IF doc ? 'gpus' THEN
""" + _GPUS + """
            END IF;
            IF doc ? 'grants' THEN
""" + _GRANTS + """
            END IF;
            IF doc ? 'queue' THEN
""" + _QUEUE + """
                UPDATE gpuguard.queue q SET gpus = x.gpus
                    FROM jsonb_to_recordset(doc->'queue') AS x(ticket integer, gpus integer)
                    WHERE q.node = me AND q.ticket = x.ticket AND q.gpus <> x.gpus;
            END IF;
            IF jsonb_array_length(doc->'ledger') > 0 THEN
""" + _LEDGER + """
            END IF;
""" + _ANSWERS + """        END IF;
""" + _USAGE_ALL + """        RETURN answer;
    END $$;
    """),
    # Least privilege, mended. Migration 5's per-schema default could not take EXECUTE from PUBLIC
    # (the global default grants it, which a per-schema one can only add to): heartbeat_v5 and
    # usage_elsewhere were callable by every role. Now every function of the schema is taken from
    # PUBLIC again, the global default of the schema's owner (and of the role migrating, when
    # another) no longer grants EXECUTE to PUBLIC, and the node functions are granted back to
    # gpuguard_nodes where fleet init made it (fleet init grants them again on every run).
    # A node's own role writes its own rows only, but those rows could still harm users of every
    # server: grants of any minor in any number, ledger rows of any length ending in any future
    # (a user's usage inflated for good: last in every queue). What the node functions write for
    # a node's role is now bounded by gpuguard.bounded (a member of the owner's role may write the
    # tables anyway, and is not): a grant only on a minor the node's GPUs list (the document's
    # when it sends them), at most GRANTS_PER_GPU on one, counting those it already has there;
    # a ledger row only when it ends by now + SKEW, starts no earlier than the node's first_seen
    # - SKEW and ends no earlier than it starts. What is refused is left out, never failing the
    # rest, and said: the answer's `skipped` (the node logs it) and a WARNING in the server's log.
    # heartbeat_v4 and reserve_v3 are made again bounded, and heartbeat_v5 becomes a bounded
    # wrapper of what it was (heartbeat_v5_unbounded, which no role but the owner may call), so
    # that nodes of schema 5 and 6 keep working, bounded too.
    Migration(7, 1, f"""
    DO $$
    DECLARE
        owner text := (SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = 'gpuguard');
    BEGIN
        EXECUTE format('ALTER DEFAULT PRIVILEGES FOR ROLE %I REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC', owner);
        IF current_user <> owner THEN
            EXECUTE format('ALTER DEFAULT PRIVILEGES FOR ROLE %I REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC', current_user);
        END IF;
    END $$;

    -- doc, with what a node's own role may not write taken out and put under `skipped`
    CREATE FUNCTION gpuguard.bounded(doc jsonb) RETURNS jsonb LANGUAGE plpgsql STABLE
        SET search_path = pg_catalog, pg_temp AS $$
    DECLARE
        me text := doc->>'node';
        at double precision := extract(epoch FROM clock_timestamp());
        since double precision;
        minors integer[];
        skipped jsonb := '{{}}';
        kept jsonb;
        dropped jsonb;
    BEGIN
        IF pg_has_role(session_user, (SELECT nspowner FROM pg_namespace WHERE nspname = 'gpuguard'), 'USAGE') THEN
            RETURN doc;
        END IF;
        since := coalesce((SELECT n.first_seen FROM gpuguard.nodes n WHERE n.name = me), at) - {SKEW:.0f};
        minors := CASE WHEN jsonb_typeof(doc->'gpus') = 'array'
                       THEN ARRAY(SELECT x.minor FROM jsonb_to_recordset(doc->'gpus') AS x(minor integer))
                       ELSE ARRAY(SELECT g.minor FROM gpuguard.gpus g WHERE g.node = me) END;
        IF jsonb_typeof(doc->'grants') = 'array' THEN
            -- those of the node's grants on a GPU that the document does not name stay (granted after it was taken)
            SELECT coalesce(jsonb_agg(y.e ORDER BY y.i) FILTER (WHERE y.ok), '[]'),
                   jsonb_agg(y.e ORDER BY y.i) FILTER (WHERE NOT y.ok) INTO kept, dropped FROM (
                SELECT x.e, x.i, coalesce(x.minor = ANY (minors) AND x.k + (
                    SELECT count(*) FROM gpuguard.grants g WHERE g.node = me AND g.minor = x.minor AND NOT EXISTS (
                        SELECT 1 FROM jsonb_array_elements(doc->'grants') AS d(e)
                        WHERE (d.e->>'minor')::integer = g.minor AND d.e->>'username' = g.username))
                    <= {GRANTS_PER_GPU}, false) AS ok
                FROM (SELECT d.e, d.i, (d.e->>'minor')::integer AS minor,
                             row_number() OVER (PARTITION BY d.e->>'minor'
                                                ORDER BY (d.e->>'granted_at')::double precision, d.e->>'username') AS k
                      FROM jsonb_array_elements(doc->'grants') WITH ORDINALITY AS d(e, i)) x) y;
{_kept("grants")}        END IF;
        IF jsonb_typeof(doc->'minors') = 'array' THEN  -- a grant-time check's
            SELECT coalesce(jsonb_agg(y.m ORDER BY y.i) FILTER (WHERE y.ok), '[]'),
                   jsonb_agg(y.m ORDER BY y.i) FILTER (WHERE NOT y.ok) INTO kept, dropped FROM (
                SELECT x.m, x.i, coalesce(x.m = ANY (minors) AND x.k + (
                    SELECT count(*) FROM gpuguard.grants g WHERE g.node = me AND g.minor = x.m)
                    <= {GRANTS_PER_GPU}, false) AS ok
                FROM (SELECT d.m::integer AS m, d.i, row_number() OVER (PARTITION BY d.m ORDER BY d.i) AS k
                      FROM jsonb_array_elements_text(doc->'minors') WITH ORDINALITY AS d(m, i)) x) y;
{_kept("minors")}        END IF;
        IF jsonb_typeof(doc->'ledger') = 'array' THEN
            SELECT coalesce(jsonb_agg(x.e ORDER BY x.i) FILTER (WHERE x.ok), '[]'),
                   jsonb_agg(x.e ORDER BY x.i) FILTER (WHERE NOT x.ok) INTO kept, dropped FROM (
                SELECT d.e, d.i, coalesce((d.e->>'ended')::double precision <= at + {SKEW:.0f}
                                     AND (d.e->>'started')::double precision >= since
                                     AND (d.e->>'started')::double precision <= (d.e->>'ended')::double precision,
                                     false) AS ok
                FROM jsonb_array_elements(doc->'ledger') WITH ORDINALITY AS d(e, i)) x;
{_kept("ledger")}        END IF;
        IF skipped <> '{{}}' THEN
            RAISE WARNING 'gpuguard: rows of node % refused from role %: %', me, session_user, left(skipped::text, 2000);
            doc := doc || jsonb_build_object('skipped', skipped);
        END IF;
        RETURN doc;
    END $$;

    -- answer, with what bounded(doc) took out of doc
    CREATE FUNCTION gpuguard.with_skipped(answer jsonb, bounded jsonb) RETURNS jsonb LANGUAGE sql IMMUTABLE
        SET search_path = pg_catalog, pg_temp AS $$
        SELECT CASE WHEN bounded ? 'skipped' THEN answer || jsonb_build_object('skipped', bounded->'skipped')
                    ELSE answer END $$;

""" + _bounded_checked("heartbeat_v4", "heartbeat_v3") + "\n" + _bounded_checked("reserve_v3", "reserve_v2") + """
    ALTER FUNCTION gpuguard.heartbeat_v5(jsonb) RENAME TO heartbeat_v5_unbounded;
    CREATE FUNCTION gpuguard.heartbeat_v5(doc jsonb) RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER
        SET search_path = pg_catalog, pg_temp AS $$
    DECLARE
        kept jsonb := gpuguard.bounded(doc);
    BEGIN
        RETURN gpuguard.with_skipped(gpuguard.heartbeat_v5_unbounded(kept - 'skipped'), kept);
    END $$;

    REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA gpuguard FROM PUBLIC;
    DO $$
    BEGIN
        IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'gpuguard_nodes') THEN
            REVOKE EXECUTE ON FUNCTION gpuguard.heartbeat_v5_unbounded(jsonb) FROM gpuguard_nodes;
            GRANT EXECUTE ON FUNCTION gpuguard.heartbeat_v4(jsonb), gpuguard.heartbeat_v5(jsonb),
                gpuguard.reserve_v3(jsonb), gpuguard.release_v1(text, integer[], text[]) TO gpuguard_nodes;
        END IF;
    END $$;
    """),
    # A heartbeat that only says "still here" takes the short way (most of a node's heartbeats:
    # nothing it mirrors changed, no ledger row to add): heartbeat_v6 writes last_seen in one
    # UPDATE and answers, without the checks and bounds of what a heartbeat writes besides
    # (gpuguard.bounded, with_skipped, heartbeat_v5_unbounded: three function calls, each
    # setting search_path, which cost a heartbeat more database CPU than its write). The UPDATE
    # keeps writes_for's check and the digest's (the row still has what the node last sent).
    # Every other heartbeat is heartbeat_v5, bounded as before. with_skipped, which every bounded
    # call (a grant-time check too) ends with, is made again in plpgsql: a SQL function with a
    # SET clause is planned again at each call, plpgsql keeps its plan for the connection.
    Migration(8, 1, """
    CREATE OR REPLACE FUNCTION gpuguard.with_skipped(answer jsonb, bounded jsonb) RETURNS jsonb
        LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    BEGIN
        IF bounded ? 'skipped' THEN
            RETURN answer || jsonb_build_object('skipped', bounded->'skipped');
        END IF;
        RETURN answer;
    END $$;

    CREATE FUNCTION gpuguard.heartbeat_v6(doc jsonb) RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER
        SET search_path = pg_catalog, pg_temp AS $$
    DECLARE
        me text := doc->>'node';
        at double precision := extract(epoch FROM clock_timestamp());
        half double precision := (doc->>'half_life')::double precision;
        clash jsonb;
        clash_for double precision;  -- how long a clash is told (lease + grace)
        answer jsonb;
    BEGIN
        IF NOT doc ? 'since' OR doc ?| ARRAY['gpus', 'grants', 'queue']
           OR coalesce(jsonb_array_length(doc->'ledger'), 0) > 0 THEN
            RETURN gpuguard.heartbeat_v5(doc);
        END IF;
""" + _SEEN + _ANSWERS + _USAGE_ALL + """        RETURN answer;
    END $$;

    REVOKE EXECUTE ON FUNCTION gpuguard.heartbeat_v6(jsonb) FROM PUBLIC;
    DO $$
    BEGIN
        IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'gpuguard_nodes') THEN
            GRANT EXECUTE ON FUNCTION gpuguard.heartbeat_v6(jsonb) TO gpuguard_nodes;
        END IF;
    END $$;
    """),
    # What one node's role writes, every node reads: bounded in size now too. A 40 MB ssh line
    # (repeated on each GPU's row of the view) made every node's `status --fleet` and `where`
    # time out. Texts a node writes are at most TEXT_MAX characters (CHECKs: a heartbeat over it
    # fails whole, as for a bad time; rows over it from before are taken out first, as schema 3
    # did, and a node's own come back with its next heartbeat), and a heartbeat's GPUs past
    # GPUS_PER_NODE are left out (`skipped`):
    # gpuguard.bounded is made again as that cap around the old one (bounded_v1). A grant-time
    # check may grant only on GPUs the node's rows list: bounded read a `gpus` list from its
    # document too, which reserve_v2 never writes, and one check planted 300 grants on GPUs no
    # view shows (a user then "held 300" on every node); reserve_v3 now hides it from bounded.
    Migration(9, 1, f"""
{_texts_bounded()}
    ALTER FUNCTION gpuguard.bounded(jsonb) RENAME TO bounded_v1;
    CREATE FUNCTION gpuguard.bounded(doc jsonb) RETURNS jsonb LANGUAGE plpgsql STABLE
        SET search_path = pg_catalog, pg_temp AS $$
    DECLARE
        dropped jsonb;
    BEGIN
        IF jsonb_typeof(doc->'gpus') = 'array' AND jsonb_array_length(doc->'gpus') > {GPUS_PER_NODE}
           AND NOT pg_has_role(session_user, (SELECT nspowner FROM pg_namespace WHERE nspname = 'gpuguard'), 'USAGE') THEN
            dropped := jsonb_path_query_array(doc->'gpus', '$[{GPUS_PER_NODE} to last]');
            doc := jsonb_set(doc, '{{gpus}}', jsonb_path_query_array(doc->'gpus', '$[0 to {GPUS_PER_NODE - 1}]'));
            RAISE WARNING 'gpuguard: % GPUs of node % refused from role %: more than {GPUS_PER_NODE}',
                jsonb_array_length(dropped), doc->>'node', session_user;
        END IF;
        doc := gpuguard.bounded_v1(doc);
        IF dropped IS NOT NULL THEN
            doc := doc || jsonb_build_object('skipped', coalesce(doc->'skipped', '{{}}') || jsonb_build_object('gpus', dropped));
        END IF;
        RETURN doc;
    END $$;
    REVOKE EXECUTE ON FUNCTION gpuguard.bounded(jsonb) FROM PUBLIC;
""" + _bounded_checked("reserve_v3", "reserve_v2", ignored=" - 'gpus'") + """
    """),
)
CURRENT = MIGRATIONS[-1].version

