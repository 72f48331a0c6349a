//! The shared stores behind several `idem serve` processes: PostgreSQL, Redis and Redis Cluster.
//! Each runs the same scenarios; the outage tests start, kill and restart private servers.

mod common;
mod scenarios;
mod servers;

use idem_test_support::private::{PrivatePostgres, PrivateRedis};

const INSTANCES: usize = 3;
const COPIES: usize = 60;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sixty_copies_over_three_instances_run_once() {
    scenarios::copies_run_once(&servers::postgres_url(), INSTANCES, COPIES).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sixty_copies_over_three_instances_run_once() {
    scenarios::copies_run_once(&servers::redis_url(), INSTANCES, COPIES).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_sixty_copies_over_three_instances_run_once() {
    scenarios::copies_run_once(&servers::redis_cluster_url(), INSTANCES, COPIES).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crashed_holder_is_taken_over() {
    scenarios::crashed_holder_is_taken_over(&servers::postgres_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_crashed_holder_is_taken_over() {
    scenarios::crashed_holder_is_taken_over(&servers::redis_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_crashed_holder_is_taken_over() {
    scenarios::crashed_holder_is_taken_over(&servers::redis_cluster_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_skewed_clock_never_takes_over_a_healthy_run() {
    scenarios::a_skewed_clock_never_takes_over_a_healthy_run(&servers::postgres_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_skewed_clock_never_takes_over_a_healthy_run() {
    scenarios::a_skewed_clock_never_takes_over_a_healthy_run(&servers::redis_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_a_skewed_clock_never_takes_over_a_healthy_run() {
    scenarios::a_skewed_clock_never_takes_over_a_healthy_run(&servers::redis_cluster_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_list_answers_an_investigations_questions() {
    scenarios::list_answers_an_investigations_questions(&servers::postgres_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_list_answers_an_investigations_questions() {
    scenarios::list_answers_an_investigations_questions(&servers::redis_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_list_answers_an_investigations_questions() {
    scenarios::list_answers_an_investigations_questions(&servers::redis_cluster_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_operator_commands_work() {
    scenarios::operator_commands_work(&servers::postgres_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_operator_commands_work() {
    scenarios::operator_commands_work(&servers::redis_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_operator_commands_work() {
    scenarios::operator_commands_work(&servers::redis_cluster_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_deleting_a_key_in_flight_marks_the_next_run_recovered() {
    scenarios::delete_in_flight_marks_the_next_run_recovered(&servers::postgres_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_deleting_a_key_in_flight_marks_the_next_run_recovered() {
    scenarios::delete_in_flight_marks_the_next_run_recovered(&servers::redis_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_outage_fails_closed_and_recovers() {
    let server = tokio::task::spawn_blocking(PrivatePostgres::start)
        .await
        .expect("start PostgreSQL");
    let url = server.url();
    let server = std::sync::Arc::new(server);
    let (k, r) = (server.clone(), server.clone());
    scenarios::outage_fails_closed_and_recovers(
        &url,
        async move || tokio::task::spawn_blocking(move || k.kill()).await.expect("kill"),
        async move || tokio::task::spawn_blocking(move || r.restart()).await.expect("restart"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_fails_closed_and_recovers() {
    let server = std::sync::Arc::new(std::sync::Mutex::new(PrivateRedis::start()));
    let url = server.lock().expect("lock").url();
    let (k, r) = (server.clone(), server.clone());
    scenarios::outage_fails_closed_and_recovers(
        &url,
        async move || {
            tokio::task::spawn_blocking(move || k.lock().expect("lock").kill())
                .await
                .expect("kill")
        },
        async move || {
            tokio::task::spawn_blocking(move || r.lock().expect("lock").restart())
                .await
                .expect("restart")
        },
    )
    .await;
}

/// `idem serve` says at start what the PostgreSQL server's settings can lose, once: here a
/// `synchronous_commit = off` set in the store URL, which a crash of the server can lose commits
/// with, and the default, on a server without standbys, which no failover can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_start_up_log_says_what_the_server_can_lose() {
    let upstream = common::Upstream::start().await;
    let off = format!("{}&options=-c%20synchronous_commit%3Doff", servers::postgres_url());
    let gateway = common::Gateway::start_on_store(&upstream.url(), &off, &[]).await;
    let log = gateway.stderr();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("WARN") && line.contains("synchronous_commit = off: a crash of the server"))
        .collect();
    assert_eq!(warnings.len(), 1, "one warning about synchronous_commit = off:\n{log}");

    let gateway = common::Gateway::start_on_store(&upstream.url(), &servers::postgres_url(), &[]).await;
    let log = gateway.stderr();
    assert!(
        log.lines()
            .any(|line| line.contains("INFO") && line.contains("no PostgreSQL standby streams from this server")),
        "the start-up log says the server has no standby:\n{log}"
    );
    assert!(!log.contains("synchronous_commit = off"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_delete_reaches_every_gateways_replay_cache() {
    scenarios::a_delete_reaches_every_gateways_replay_cache(&servers::postgres_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_delete_reaches_every_gateways_replay_cache() {
    scenarios::a_delete_reaches_every_gateways_replay_cache(&servers::redis_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_a_delete_reaches_every_gateways_replay_cache() {
    scenarios::a_delete_reaches_every_gateways_replay_cache(&servers::redis_cluster_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_cached_answer_stops_at_its_expiry() {
    scenarios::a_cached_answer_stops_at_its_expiry(&servers::postgres_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_cached_answer_stops_at_its_expiry() {
    scenarios::a_cached_answer_stops_at_its_expiry(&servers::redis_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_stopped_gateway_forgets_what_was_deleted_while_it_slept() {
    scenarios::a_stopped_gateway_forgets_what_was_deleted_while_it_slept(&servers::redis_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_stopped_gateway_forgets_what_was_deleted_while_it_slept() {
    scenarios::a_stopped_gateway_forgets_what_was_deleted_while_it_slept(&servers::postgres_url()).await;
}
