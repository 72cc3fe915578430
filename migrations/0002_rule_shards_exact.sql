-- Hot-key options per rule:
--   shards  split the limit into this many sub-buckets (1..64), each with
--           1/shards of capacity and refill, spread over Redis Cluster nodes
--   exact   never lease tokens in batches for this pair
-- The change event now carries both, so gateways apply them at once.

ALTER TABLE rate_limit_rule
    ADD COLUMN shards integer NOT NULL DEFAULT 1 CHECK (shards BETWEEN 1 AND 64),
    ADD COLUMN exact  boolean NOT NULL DEFAULT false;

CREATE OR REPLACE FUNCTION tollgate_rule_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE'
       OR (TG_OP = 'UPDATE' AND (OLD.tenant_id, OLD.route_id) IS DISTINCT FROM (NEW.tenant_id, NEW.route_id)) THEN
        PERFORM pg_notify('tollgate_rules', json_build_object(
            'op', 'delete', 'tenant', OLD.tenant_id, 'route', OLD.route_id)::text);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM pg_notify('tollgate_rules', json_build_object(
            'op', 'upsert', 'tenant', NEW.tenant_id, 'route', NEW.route_id,
            'capacity', NEW.capacity, 'refill_per_second', NEW.refill_per_second,
            'shards', NEW.shards, 'exact', NEW.exact)::text);
    END IF;
    RETURN NULL;
END;
$$;
