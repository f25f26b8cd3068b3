CREATE OR REPLACE FUNCTION django_semaphore_queue_v1(p_names text[], p_lock_wait text) RETURNS void LANGUAGE plpgsql VOLATILE AS $queue$
BEGIN
 PERFORM set_config('lock_timeout', p_lock_wait, true);
 IF cardinality(p_names) = 1 THEN
  PERFORM pg_advisory_xact_lock(1397050689, hashtext((p_names)[1]));
 ELSE
  DECLARE k integer; BEGIN
   FOR k IN SELECT DISTINCT hashtext(n) FROM unnest(p_names) AS n ORDER BY 1 LOOP
    PERFORM pg_advisory_xact_lock(1397050689, k);
   END LOOP;
  END;
 END IF;
END
$queue$
-- end of statement
CREATE OR REPLACE FUNCTION django_semaphore_grant_v1(p_names text[], p_counts integer[], p_key text, p_owner text, p_ttl integer, p_lock_wait text) RETURNS TABLE (granted_request bigint, granted_at timestamptz, granted_expires_at timestamptz, granted_name text, granted_token bigint, granted_in_use bigint) LANGUAGE plpgsql VOLATILE AS $grant$
DECLARE s record; i integer; v_count integer; v_released bigint; v_ids bigint[] := '{}'; v_names text[] := '{}'; v_counts integer[] := '{}'; v_capacities bigint[] := '{}'; v_counted bigint[] := '{}'; v_folded bigint[] := '{}'; v_tokens bigint[] := '{}'; v_held bigint[] := '{}'; v_now timestamptz; v_expires timestamptz; v_request bigint;
BEGIN
 PERFORM set_config('lock_timeout', p_lock_wait, true);
 IF cardinality(p_names) = 1 THEN
  PERFORM pg_advisory_xact_lock(1397050689, hashtext((p_names)[1]));
 ELSE
  DECLARE k integer; BEGIN
   FOR k IN SELECT DISTINCT hashtext(n) FROM unnest(p_names) AS n ORDER BY 1 LOOP
    PERFORM pg_advisory_xact_lock(1397050689, k);
   END LOOP;
  END;
 END IF;
 FOR s IN SELECT "django_semaphore_semaphore"."id" AS "id", "django_semaphore_semaphore"."name" AS "name", "django_semaphore_semaphore"."capacity" AS "capacity", "django_semaphore_semaphore"."in_use_counter" AS "in_use_counter", "django_semaphore_semaphore"."released_folded" AS "released_folded", "django_semaphore_semaphore"."fencing_counter" AS "fencing_counter", "django_semaphore_semaphore"."fair" AS "fair", "django_semaphore_semaphore"."queued_until" AS "queued_until", "django_semaphore_semaphore"."queued_until" > (CLOCK_TIMESTAMP()) AS "queue_live", "django_semaphore_semaphore"."window" AS "window", "django_semaphore_semaphore"."slots_open" AS "slots_open", "django_semaphore_semaphore"."slots_closed_until" AS "slots_closed_until" FROM "django_semaphore_semaphore" WHERE "django_semaphore_semaphore"."name" = ANY(p_names) ORDER BY 2 ASC FOR UPDATE LOOP
  v_count := p_counts[array_position(p_names, s.name::text)];
  IF v_count IS NULL OR s."window" IS NOT NULL OR COALESCE(s.queue_live, false) OR v_count > s.capacity THEN RETURN; END IF;
  v_ids := v_ids || s.id::bigint; v_names := v_names || s.name::text; v_counts := v_counts || v_count; v_capacities := v_capacities || s.capacity::bigint; v_counted := v_counted || s.in_use_counter::bigint; v_folded := v_folded || s.released_folded::bigint; v_tokens := v_tokens || (s.fencing_counter + 1)::bigint;
 END LOOP;
 IF cardinality(v_ids) <> cardinality(p_names) THEN RETURN; END IF;
 FOR i IN 1 .. cardinality(v_ids) LOOP
  SELECT c."released" INTO v_released FROM "django_semaphore_releasecounter" c WHERE c."semaphore_id" = v_ids[i];
  v_held := v_held || GREATEST(v_counted[i] - GREATEST(COALESCE(v_released, 0) - v_folded[i], 0), 0);
  IF v_held[i] + v_counts[i] > v_capacities[i] THEN RETURN; END IF;
  v_folded[i] := GREATEST(COALESCE(v_released, 0), v_folded[i]);
 END LOOP;
 v_now := clock_timestamp();
 v_expires := v_now + make_interval(secs => p_ttl);
 INSERT INTO "django_semaphore_permitrequest" ("external_id", "owner", "state", "ttl", "expires_at", "created_at", "updated_at", "released_at", "release_reason") VALUES (p_key, p_owner, 'ACQUIRED', p_ttl, v_expires, v_now, v_now, NULL, '') RETURNING "id" INTO v_request;
 FOR i IN 1 .. cardinality(v_ids) LOOP
  UPDATE "django_semaphore_semaphore" SET "fencing_counter" = "fencing_counter" + 1, "in_use_counter" = v_held[i] + v_counts[i], "released_folded" = v_folded[i], "updated_at" = v_now WHERE "id" = v_ids[i];
 END LOOP;
 INSERT INTO "django_semaphore_permit" ("semaphore_id", "request_id", "count", "fencing_token", "slot_ends", "state") SELECT g.id, v_request, g.n, g.token, NULL, 'ACQUIRED' FROM unnest(v_ids, v_counts, v_tokens) AS g(id, n, token) ORDER BY g.id;
 RETURN QUERY SELECT v_request, v_now, v_expires, g.name, g.token, g.held + g.n FROM unnest(v_names, v_tokens, v_held, v_counts) AS g(name, token, held, n);
END
$grant$
-- end of statement
CREATE OR REPLACE FUNCTION django_semaphore_grant_one_v1(p_name text, p_count integer, p_key text, p_owner text, p_ttl integer, p_lock_wait text, p_ticketed boolean, p_lacked boolean, p_fair boolean, p_life double precision) RETURNS TABLE (granted_request bigint, granted_at timestamptz, granted_expires_at timestamptz, granted_name text, granted_token bigint, granted_in_use bigint, refused_id bigint, refused_capacity bigint, refused_rounds bigint, refused_ticket boolean) LANGUAGE plpgsql VOLATILE AS $grant$
DECLARE s record; v_released bigint; v_held bigint; v_now timestamptz; v_until timestamptz; v_deadline timestamptz; v_live boolean := false; v_ahead bigint := 0; v_reserved bigint := 0;
BEGIN
 PERFORM set_config('lock_timeout', p_lock_wait, true);
 PERFORM pg_advisory_xact_lock(1397050689, hashtext(p_name));
 SELECT "django_semaphore_semaphore"."id" AS "id", "django_semaphore_semaphore"."name" AS "name", "django_semaphore_semaphore"."capacity" AS "capacity", "django_semaphore_semaphore"."in_use_counter" AS "in_use_counter", "django_semaphore_semaphore"."released_folded" AS "released_folded", "django_semaphore_semaphore"."fencing_counter" AS "fencing_counter", "django_semaphore_semaphore"."fair" AS "fair", "django_semaphore_semaphore"."queued_until" AS "queued_until", "django_semaphore_semaphore"."queued_until" > (CLOCK_TIMESTAMP()) AS "queue_live", "django_semaphore_semaphore"."window" AS "window", "django_semaphore_semaphore"."slots_open" AS "slots_open", "django_semaphore_semaphore"."slots_closed_until" AS "slots_closed_until" INTO s FROM "django_semaphore_semaphore" WHERE "django_semaphore_semaphore"."name" = p_name ORDER BY 2 ASC FOR UPDATE;
 IF NOT FOUND OR s.name::text <> p_name OR s."window" IS NOT NULL OR p_count > s.capacity THEN RETURN; END IF;
 SELECT c."released" INTO v_released FROM "django_semaphore_releasecounter" c WHERE c."semaphore_id" = s.id;
 v_held := GREATEST(s.in_use_counter - GREATEST(COALESCE(v_released, 0) - s.released_folded, 0), 0);
 v_now := clock_timestamp();
 IF s.queued_until > v_now OR p_ticketed OR v_held + p_count > s.capacity THEN
  v_live := COALESCE(s.queued_until > v_now, false);
  IF v_live THEN SELECT COUNT(*), COALESCE(SUM(o.permits), 0) INTO v_ahead, v_reserved FROM (SELECT t."semaphore_id", COUNT(*) AS n, SUM(t."count") AS permits FROM "django_semaphore_ticket" t WHERE t."semaphore_id" IN (s.id) AND t."lacked" = TRUE AND t."expires_at" > v_now AND t."external_id" <> p_key AND NOT EXISTS (SELECT 1 FROM "django_semaphore_ticket" m WHERE m."semaphore_id" = t."semaphore_id" AND m."external_id" = p_key AND m."id" < t."id") GROUP BY t."semaphore_id") o; END IF;
  IF v_held + p_count + v_reserved > s.capacity THEN
   IF p_life IS NOT NULL AND NOT (v_live OR p_ticketed OR p_fair OR s.fair) OR EXISTS (SELECT "id", "state", "external_id" FROM "django_semaphore_permitrequest" WHERE "external_id" = p_key) OR (v_held + p_count > s.capacity AND EXISTS(SELECT 1 FROM "django_semaphore_permitrequest" r JOIN "django_semaphore_permit" p ON p."request_id" = r."id" WHERE r."state" = 'ACQUIRED' AND r."expires_at" <= v_now AND p."semaphore_id" IN (s.id) AND p."state" = 'ACQUIRED')) THEN RETURN; END IF;
   v_deadline := v_now + make_interval(secs => p_life);
   IF v_reserved = 0 THEN
    v_until := LEAST(v_deadline, v_now + CASE WHEN p_life IS NOT NULL AND (p_fair OR s.fair) THEN 50000 ELSE 2000 END * interval '1 microsecond');
    WHILE v_held + p_count > s.capacity AND v_now < v_until LOOP
     PERFORM pg_sleep(500 / 1000000.0);
     SELECT c."released" INTO v_released FROM "django_semaphore_releasecounter" c WHERE c."semaphore_id" = s.id;
     v_held := GREATEST(s.in_use_counter - GREATEST(COALESCE(v_released, 0) - s.released_folded, 0), 0);
     v_now := clock_timestamp();
    END LOOP;
   END IF;
   IF v_held + p_count + v_reserved > s.capacity THEN
    refused_ticket := p_life IS NOT NULL AND (p_fair OR s.fair) AND NOT (p_ticketed AND p_lacked);
    IF refused_ticket THEN INSERT INTO "django_semaphore_ticket" ("semaphore_id", "external_id", "owner", "count", "created_at", "expires_at", "lacked") VALUES (s.id, p_key, p_owner, p_count, v_now, v_deadline, TRUE) ON CONFLICT ("semaphore_id", "external_id") DO UPDATE SET "expires_at" = GREATEST("django_semaphore_ticket"."expires_at", EXCLUDED."expires_at"), "lacked" = "django_semaphore_ticket"."lacked" OR EXCLUDED."lacked"; UPDATE "django_semaphore_semaphore" SET "queued_until" = v_deadline WHERE "id" IN (s.id) AND ("queued_until" IS NULL OR "queued_until" < v_deadline); END IF;
    granted_name := s.name; granted_token := s.fencing_counter; granted_in_use := v_held; refused_id := s.id; refused_capacity := s.capacity;
    refused_rounds := (v_reserved + p_count - 1) / GREATEST(s.capacity, 1);
    RETURN NEXT; RETURN;
   END IF;
  END IF;
  IF p_ticketed OR v_live THEN DELETE FROM "django_semaphore_ticket" WHERE "external_id" = p_key AND "semaphore_id" IN (s.id);
   IF v_live AND v_ahead = 0 AND NOT p_ticketed THEN UPDATE "django_semaphore_semaphore" SET "queued_until" = NULL WHERE "id" IN (s.id) AND NOT EXISTS (SELECT 1 FROM "django_semaphore_ticket" t WHERE t."semaphore_id" = "django_semaphore_semaphore"."id" AND t."lacked" = TRUE AND t."expires_at" > v_now); END IF;
  END IF;
 END IF;
 granted_at := v_now;
 granted_expires_at := granted_at + make_interval(secs => p_ttl);
 INSERT INTO "django_semaphore_permitrequest" ("external_id", "owner", "state", "ttl", "expires_at", "created_at", "updated_at", "released_at", "release_reason") VALUES (p_key, p_owner, 'ACQUIRED', p_ttl, granted_expires_at, granted_at, granted_at, NULL, '') RETURNING "id" INTO granted_request;
 UPDATE "django_semaphore_semaphore" SET "fencing_counter" = "fencing_counter" + 1, "in_use_counter" = v_held + p_count, "released_folded" = GREATEST(COALESCE(v_released, 0), s.released_folded), "updated_at" = granted_at WHERE "id" = s.id;
 INSERT INTO "django_semaphore_permit" ("semaphore_id", "request_id", "count", "fencing_token", "slot_ends", "state") VALUES (s.id, granted_request, p_count, s.fencing_counter + 1, NULL, 'ACQUIRED');
 granted_name := s.name; granted_token := s.fencing_counter + 1; granted_in_use := v_held + p_count;
 RETURN NEXT;
END
$grant$
-- end of statement
CREATE OR REPLACE PROCEDURE django_semaphore_release_v1(p_key text, p_reason text, p_lock_wait text, p_read text, OUT out_ended bigint, OUT out_keys text[], OUT out_requests bigint[], OUT out_granted timestamptz[], OUT out_released timestamptz[], OUT out_semaphore_ids bigint[], OUT out_semaphores text[], OUT out_counts integer[], OUT out_parked boolean[]) LANGUAGE plpgsql AS $release$
BEGIN
 WITH r AS (UPDATE "django_semaphore_permitrequest" SET "state" = 'RELEASED', "released_at" = CLOCK_TIMESTAMP(), "updated_at" = CLOCK_TIMESTAMP(), "release_reason" = p_reason WHERE "external_id" = p_key AND "state" = 'ACQUIRED' AND (SELECT set_config('lock_timeout', p_lock_wait, true)) IS NOT NULL RETURNING "id"), p AS (UPDATE "django_semaphore_permit" SET "state" = 'RELEASED' WHERE "request_id" IN (SELECT "id" FROM r) AND "state" = 'ACQUIRED' RETURNING "semaphore_id", "count"), l AS (SELECT "django_semaphore_releasecounter"."semaphore_id" AS "semaphore_id" FROM "django_semaphore_releasecounter" WHERE "django_semaphore_releasecounter"."semaphore_id" IN (SELECT "semaphore_id" FROM p) ORDER BY 1 ASC FOR UPDATE), c AS (UPDATE "django_semaphore_releasecounter" SET "released" = "released" + p."count" FROM p JOIN l ON l."semaphore_id" = p."semaphore_id" WHERE "django_semaphore_releasecounter"."semaphore_id" = l."semaphore_id") SELECT COUNT(*) FROM r INTO out_ended;
 COMMIT;
 IF out_ended > 0 AND (p_read = 'always' OR p_read = 'parked' AND EXISTS (SELECT 1 FROM "django_semaphore_parkedtask" WHERE "woken_at" IS NULL)) THEN
  SELECT array_agg(x.out_keys), array_agg(x.out_requests), array_agg(x.out_granted), array_agg(x.out_released), array_agg(x.out_semaphore_ids), array_agg(x.out_semaphores), array_agg(x.out_counts), array_agg(x.out_parked) INTO out_keys, out_requests, out_granted, out_released, out_semaphore_ids, out_semaphores, out_counts, out_parked FROM (SELECT r."external_id", r."id", r."created_at", r."released_at", p."semaphore_id", s."name", p."count", EXISTS (SELECT 1 FROM "django_semaphore_ticket" w JOIN "django_semaphore_parkedtask" t ON t."key" = w."external_id" WHERE w."semaphore_id" = p."semaphore_id" AND t."woken_at" IS NULL) FROM "django_semaphore_permitrequest" r JOIN "django_semaphore_permit" p ON p."request_id" = r."id" JOIN "django_semaphore_semaphore" s ON s."id" = p."semaphore_id" WHERE r."external_id" = p_key) AS x(out_keys, out_requests, out_granted, out_released, out_semaphore_ids, out_semaphores, out_counts, out_parked);
 END IF;
END
$release$
-- end of statement
