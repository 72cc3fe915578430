-- A share is at least 0.001 (the gateway's MIN_SHARE): below it a limit
-- refills too slowly for the bucket script's arithmetic, and a gateway
-- ignores such a row anyway (its scope keeps the region's default share).
-- Rows already stored are not re-checked (NOT VALID); an UPDATE of such a
-- row must bring its share to the floor or above.

ALTER TABLE region_share
    DROP CONSTRAINT region_share_share_check,
    ADD CONSTRAINT region_share_share_check
        CHECK (share >= 0.001 AND share <= 1) NOT VALID;
