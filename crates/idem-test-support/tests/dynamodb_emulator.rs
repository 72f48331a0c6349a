//! Is the DynamoDB emulator faithful where a store's correctness rests? Before a DynamoDB store is
//! built on dynalite (npm, started by `.ci/services` on 127.0.0.1:4567), these trials hold it to
//! what DynamoDB promises and idem's fencing needs: of many simultaneous conditional writes to one
//! item exactly one wins, in every trial; a write conditioned on a token that has moved on fails;
//! an expiry attribute is kept as written (DynamoDB's TTL deletes late, so a store must judge
//! expiry on read); a sparse index lists only the items that carry its key. moto failed the first
//! trial (two or three writers won one conditional write), so an emulator is trusted only on what
//! it is seen to do here.
//!
//! Seen besides, and left to the store to deal with: dynalite 4.0.0 answers `UpdateTimeToLive` and
//! `TransactWriteItems` with `UnknownOperationException` (it has `DescribeTimeToLive`), and checks
//! that a request carries a SigV4 `Authorization` header and a date, not its signature.
//!
//! The requests are DynamoDB's JSON protocol written out by hand, so that what is proved is the
//! emulator's behaviour, not a client's.

use std::sync::Arc;

use serde_json::{Value, json};
use tokio::sync::Barrier;

/// Simultaneous writers in a trial.
const WRITERS: usize = 64;
/// Trials of each kind: a race lost once in twenty would still be seen.
const TRIALS: usize = 20;

/// The emulator's endpoint: `IDEM_TEST_DYNAMODB` or dynalite where `.ci/services` starts it.
fn endpoint() -> String {
    std::env::var("IDEM_TEST_DYNAMODB").unwrap_or_else(|_| "http://127.0.0.1:4567".to_owned())
}

/// A DynamoDB error: the HTTP status and the exception's name (`ConditionalCheckFailedException`).
#[derive(Debug)]
struct Refused {
    status: u16,
    kind: String,
}

impl Refused {
    fn is(&self, kind: &str) -> bool {
        self.kind.ends_with(kind)
    }
}

/// One connection pool to the emulator.
#[derive(Clone)]
struct Dynamo {
    http: reqwest::Client,
    endpoint: String,
}

impl Dynamo {
    /// The emulator, or a failure that says how to start it.
    async fn reach() -> Self {
        let dynamo = Self {
            http: reqwest::Client::new(),
            endpoint: endpoint(),
        };
        if let Err(err) = dynamo.http.post(&dynamo.endpoint).send().await {
            panic!(
                "no DynamoDB emulator at {} ({err}): start it with `bash .ci/services` (dynalite on \
                 127.0.0.1:4567), or name another with IDEM_TEST_DYNAMODB",
                dynamo.endpoint
            );
        }
        dynamo
    }

    /// Calls `operation` (`PutItem`, …) with `body`: its answer, or how it was refused.
    async fn call(&self, operation: &str, body: Value) -> Result<Value, Refused> {
        let response = self
            .http
            .post(&self.endpoint)
            .header("content-type", "application/x-amz-json-1.0")
            .header("x-amz-target", format!("DynamoDB_20120810.{operation}"))
            .header("x-amz-date", "20261206T000000Z")
            .header(
                "authorization",
                "AWS4-HMAC-SHA256 Credential=idem/20261206/us-east-1/dynamodb/aws4_request, \
                 SignedHeaders=host;x-amz-date;x-amz-target, Signature=0",
            )
            .body(body.to_string())
            .send()
            .await
            .unwrap_or_else(|err| panic!("{operation}: the emulator did not answer: {err}"));
        let status = response.status().as_u16();
        let body = response.bytes().await.unwrap_or_default();
        let answer: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if status == 200 {
            return Ok(answer);
        }
        let kind = answer["__type"].as_str().unwrap_or("").to_owned();
        Err(Refused { status, kind })
    }

    /// A new table keyed by `pk` (a string); with `listed`, a sparse index on `listed` and
    /// `created_at`, as `idem list` would read.
    async fn new_table(&self, listed: bool) -> String {
        let name = format!("idem-trial-{}", uuid::Uuid::new_v4());
        let mut table = json!({
            "TableName": name,
            "AttributeDefinitions": [{"AttributeName": "pk", "AttributeType": "S"}],
            "KeySchema": [{"AttributeName": "pk", "KeyType": "HASH"}],
            "BillingMode": "PAY_PER_REQUEST",
        });
        if listed {
            table["AttributeDefinitions"] = json!([
                {"AttributeName": "pk", "AttributeType": "S"},
                {"AttributeName": "listed", "AttributeType": "S"},
                {"AttributeName": "created_at", "AttributeType": "N"},
            ]);
            table["GlobalSecondaryIndexes"] = json!([{
                "IndexName": "by-creation",
                "KeySchema": [
                    {"AttributeName": "listed", "KeyType": "HASH"},
                    {"AttributeName": "created_at", "KeyType": "RANGE"},
                ],
                "Projection": {"ProjectionType": "KEYS_ONLY"},
            }]);
        }
        self.call("CreateTable", table).await.expect("CreateTable");
        for _ in 0..100 {
            let described = self
                .call("DescribeTable", json!({"TableName": name}))
                .await
                .expect("DescribeTable");
            if described["Table"]["TableStatus"] == "ACTIVE" {
                return name;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        panic!("table {name} did not become ACTIVE within 5 s");
    }

    /// The item `pk` read with strong consistency, if any.
    async fn item(&self, table: &str, pk: &str) -> Option<Value> {
        let read = json!({"TableName": table, "Key": {"pk": {"S": pk}}, "ConsistentRead": true});
        let answer = self.call("GetItem", read).await.expect("GetItem");
        answer.get("Item").cloned()
    }
}

/// Runs `WRITERS` calls of `operation` at once, the `i`th with `body(i)`: which writers were
/// answered 200. Every other answer must be `ConditionalCheckFailedException`.
async fn race(dynamo: &Dynamo, operation: &'static str, body: impl Fn(usize) -> Value) -> Vec<usize> {
    let start = Arc::new(Barrier::new(WRITERS));
    let writers: Vec<_> = (0..WRITERS)
        .map(|writer| {
            let (dynamo, start, body) = (dynamo.clone(), start.clone(), body(writer));
            tokio::spawn(async move {
                start.wait().await;
                (writer, dynamo.call(operation, body).await)
            })
        })
        .collect();
    let mut won = Vec::new();
    for writer in writers {
        match writer.await.expect("a writer panicked") {
            (writer, Ok(_)) => won.push(writer),
            (_, Err(refused)) if refused.is("ConditionalCheckFailedException") && refused.status == 400 => {}
            (writer, Err(refused)) => panic!("{operation} by writer {writer}: refused otherwise: {refused:?}"),
        }
    }
    won
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn of_many_conditional_puts_to_one_item_exactly_one_wins() {
    let dynamo = Dynamo::reach().await;
    let table = dynamo.new_table(false).await;
    for trial in 0..TRIALS {
        let pk = format!("claim-{trial}");
        let won = race(&dynamo, "PutItem", |writer| {
            json!({
                "TableName": table,
                "Item": {"pk": {"S": pk}, "token": {"S": format!("t{writer}")}},
                "ConditionExpression": "attribute_not_exists(pk)",
            })
        })
        .await;
        assert_eq!(won.len(), 1, "trial {trial}: writers {won:?} all created {pk}");
        let item = dynamo.item(&table, &pk).await.expect("the winner's item");
        assert_eq!(
            item["token"]["S"],
            format!("t{}", won[0]),
            "trial {trial}: the winner's token is kept"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_fenced_on_a_token_has_one_winner_and_a_stale_token_fails() {
    let dynamo = Dynamo::reach().await;
    let table = dynamo.new_table(false).await;
    for trial in 0..TRIALS {
        let pk = format!("fenced-{trial}");
        let first = json!({"TableName": table, "Item": {"pk": {"S": pk}, "token": {"S": "t0"}}});
        dynamo.call("PutItem", first).await.expect("PutItem");
        let take_over = |old: &str, new: String| {
            json!({
                "TableName": table,
                "Key": {"pk": {"S": pk}},
                "UpdateExpression": "SET #token = :new",
                "ConditionExpression": "#token = :old",
                "ExpressionAttributeNames": {"#token": "token"},
                "ExpressionAttributeValues": {":old": {"S": old}, ":new": {"S": new}},
            })
        };
        let won = race(&dynamo, "UpdateItem", |writer| {
            take_over("t0", format!("t{}", writer + 1))
        })
        .await;
        assert_eq!(
            won.len(),
            1,
            "trial {trial}: writers {won:?} all took the claim on t0 over"
        );
        let current = format!("t{}", won[0] + 1);
        let item = dynamo.item(&table, &pk).await.expect("the item");
        assert_eq!(
            item["token"]["S"], current,
            "trial {trial}: the winner's token is current"
        );

        let stale = dynamo.call("UpdateItem", take_over("t0", "late".to_owned())).await;
        assert!(
            stale
                .as_ref()
                .is_err_and(|refused| refused.is("ConditionalCheckFailedException")),
            "trial {trial}: a write on the stale token t0 fails: {stale:?}"
        );
        let item = dynamo.item(&table, &pk).await.expect("the item");
        assert_eq!(
            item["token"]["S"], current,
            "trial {trial}: the stale write changed nothing"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expiry_attribute_is_kept_as_written_even_when_long_past() {
    let dynamo = Dynamo::reach().await;
    let table = dynamo.new_table(false).await;
    // Long past, just past and far ahead, in seconds as DynamoDB's TTL reads them.
    for (pk, expires) in [("past", "1"), ("now", "1796515200"), ("ahead", "4102444800")] {
        let item = json!({"TableName": table, "Item": {"pk": {"S": pk}, "expires": {"N": expires}}});
        dynamo.call("PutItem", item).await.expect("PutItem");
        let kept = dynamo.item(&table, pk).await;
        let kept = kept.unwrap_or_else(|| panic!("{pk}: an item past its expiry is still there until TTL runs"));
        assert_eq!(kept["expires"]["N"], expires, "{pk}: the expiry as written");
    }
    let ttl = dynamo
        .call("DescribeTimeToLive", json!({"TableName": table}))
        .await
        .expect("DescribeTimeToLive");
    assert!(ttl["TimeToLiveDescription"].is_object(), "{ttl}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sparse_index_lists_only_the_items_that_carry_its_key_in_creation_order() {
    let dynamo = Dynamo::reach().await;
    let table = dynamo.new_table(true).await;
    // Records carry `listed`; answer chunks (written under the same table) do not.
    for (pk, created_at) in [
        ("r3", Some(300)),
        ("chunk-1", None),
        ("r1", Some(100)),
        ("r2", Some(200)),
    ] {
        let mut item = json!({"pk": {"S": pk}});
        if let Some(at) = created_at {
            item["listed"] = json!({"S": "record"});
            item["created_at"] = json!({"N": at.to_string()});
        }
        let put = json!({"TableName": table, "Item": item});
        dynamo.call("PutItem", put).await.expect("PutItem");
    }
    let newest_first = json!({
        "TableName": table,
        "IndexName": "by-creation",
        "KeyConditionExpression": "listed = :record AND created_at < :before",
        "ExpressionAttributeValues": {":record": {"S": "record"}, ":before": {"N": "250"}},
        "ScanIndexForward": false,
    });
    let listed = dynamo.call("Query", newest_first).await.expect("Query");
    let keys: Vec<&str> = listed["Items"]
        .as_array()
        .expect("Items")
        .iter()
        .map(|item| item["pk"]["S"].as_str().expect("pk"))
        .collect();
    assert_eq!(keys, ["r2", "r1"], "newest first, before 250, records only");
}
