-- Several limits per rule, rules of quotas only, and tenant-wide rules.
-- 1. limits: a rule's further limits beside its first token bucket, a JSON
--    array of {"capacity": n, "refill_per_second": n} or {"quota": n,
--    "window": "minute"|"hour"|"day"|"month"} or {"quota": n,
--    "window_seconds": n} objects (the gateway validates each). Every
--    existing row gets [] and stays the one-limit rule it was.
-- 2. capacity and refill_per_second may both be NULL when limits holds
--    the rule's limits (a rule of quotas only); never one without the
--    other, and never both with no limit at all.
-- 3. route_id '*' names a tenant-wide rule: its limits count every route
--    of the tenant.
-- 4. Change events carry limits. A gateway that predates them ignores the
--    field and enforces the first bucket alone; one that predates NULL
--    capacities skips such an event (it fails that gateway's validation).

ALTER TABLE rate_limit_rule
    ADD COLUMN limits jsonb NOT NULL DEFAULT '[]'::jsonb
        CHECK (jsonb_typeof(limits) = 'array' AND jsonb_array_length(limits) <= 8),
    ALTER COLUMN capacity DROP NOT NULL,
    ALTER COLUMN refill_per_second DROP NOT NULL,
    ADD CONSTRAINT rate_limit_rule_first_bucket_check
        CHECK ((capacity IS NULL) = (refill_per_second IS NULL)
               AND (capacity IS NOT NULL OR jsonb_array_length(limits) > 0));

ALTER TABLE rate_limit_rule
    DROP CONSTRAINT rate_limit_rule_route_id_check,
    ADD CONSTRAINT rate_limit_rule_route_id_check
        CHECK (route_id ~ '^[A-Za-z0-9._-]{1,64}$' OR route_id = '*') NOT VALID;

CREATE OR REPLACE FUNCTION tollgate_rule_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE'
       OR (TG_OP = 'UPDATE' AND (OLD.tenant_id, OLD.route_id) IS DISTINCT FROM (NEW.tenant_id, NEW.route_id)) THEN
        PERFORM pg_notify('tollgate_rules', json_build_object(
            'op', 'delete', 'tenant', OLD.tenant_id, 'route', OLD.route_id,
            'seq', nextval('tollgate_rule_change_seq'))::text);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM pg_notify('tollgate_rules', json_build_object(
            'op', 'upsert', 'tenant', NEW.tenant_id, 'route', NEW.route_id,
            'capacity', NEW.capacity, 'refill_per_second', NEW.refill_per_second,
            'limits', NEW.limits,
            'shards', NEW.shards, 'exact', NEW.exact, 'mode', NEW.mode, 'name', NEW.name,
            'seq', nextval('tollgate_rule_change_seq'))::text);
    END IF;
    RETURN NULL;
END;
$$;
