//! Gateways on one SQLite file, as pods behind a load balancer on one host: concurrent copies of
//! one request spread between them reach the upstream once, and a crashed holder's key is taken
//! over by another instance.

mod common;
mod scenarios;

fn sqlite_store(dir: &tempfile::TempDir) -> String {
    common::store_url_in(dir.path())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_copies_across_two_instances_run_once() {
    let dir = tempfile::tempdir().expect("a temp dir");
    scenarios::copies_run_once(&sqlite_store(&dir), 2, 50).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_holders_key_is_taken_over_and_the_rerun_is_marked_recovered() {
    let dir = tempfile::tempdir().expect("a temp dir");
    scenarios::crashed_holder_is_taken_over(&sqlite_store(&dir)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operators_commands_work_on_sqlite() {
    let dir = tempfile::tempdir().expect("a temp dir");
    scenarios::operator_commands_work(&sqlite_store(&dir)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_answers_an_investigations_questions_on_sqlite() {
    let dir = tempfile::tempdir().expect("a temp dir");
    scenarios::list_answers_an_investigations_questions(&sqlite_store(&dir)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_key_in_flight_marks_the_next_run_recovered_on_sqlite() {
    let dir = tempfile::tempdir().expect("a temp dir");
    scenarios::delete_in_flight_marks_the_next_run_recovered(&sqlite_store(&dir)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_by_another_process_reaches_every_gateways_replay_cache_on_sqlite() {
    let dir = tempfile::tempdir().expect("a temp dir");
    scenarios::a_delete_reaches_every_gateways_replay_cache(&sqlite_store(&dir)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_answer_stops_at_its_expiry_on_sqlite() {
    let dir = tempfile::tempdir().expect("a temp dir");
    scenarios::a_cached_answer_stops_at_its_expiry(&sqlite_store(&dir)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_gateway_forgets_what_was_deleted_while_it_slept_on_sqlite() {
    let dir = tempfile::tempdir().expect("a temp dir");
    scenarios::a_stopped_gateway_forgets_what_was_deleted_while_it_slept(&sqlite_store(&dir)).await;
}
