//! Thread scaling through the admin API, in process: `GET /v1/scaling` shows the active
//! threads, `POST /v1/scaling` parks and wakes them (an operator's call, carried out before
//! the answer), bad bodies are refused, one thread has nothing to scale, and `/metrics` has
//! the active count and the events.

mod admin_common;

use admin_common::{config, start};

#[test]
fn an_operator_parks_and_wakes_a_thread() {
    let (server, api) = start(reflex_server::Config {
        threads: 2,
        ..config(None)
    });
    let state = api.get("/v1/scaling");
    assert_eq!(state.status, 200, "{}", state.text);
    let state = state.json();
    assert_eq!(state["threads"], 2);
    assert_eq!(state["active"], 2);
    assert_eq!(state["enabled"], false);
    assert_eq!(state["events"].as_array().map(Vec::len), Some(0));

    let parked = api.post("/v1/scaling", r#"{"active": 1}"#);
    assert_eq!(parked.status, 200, "{}", parked.text);
    let parked = parked.json();
    assert_eq!(parked["active"], 1);
    assert_eq!(
        parked["active_per_thread"],
        serde_json::json!([true, false])
    );
    assert_eq!(parked["parks_total"], 1);
    let event = &parked["events"][0];
    assert_eq!(
        (
            &event["kind"],
            &event["thread"],
            &event["to"],
            &event["cause"]
        ),
        (
            &serde_json::json!("park"),
            &serde_json::json!(1),
            &serde_json::json!(0),
            &serde_json::json!("admin")
        )
    );
    // Asking for the same again changes nothing.
    assert_eq!(
        api.post("/v1/scaling", r#"{"active": 1}"#).json()["parks_total"],
        1
    );

    let metrics = api.get("/metrics").text;
    assert!(metrics.contains("reflex_threads_active{} 1"), "{metrics}");
    assert!(
        metrics.contains("reflex_scaling_events_total{kind=\"park\"} 1"),
        "{metrics}"
    );

    // More than the threads started: all of them.
    let woken = api.post("/v1/scaling", r#"{"active": 9}"#).json();
    assert_eq!(woken["active"], 2);
    assert_eq!(woken["wakes_total"], 1);

    for bad in [r#"{"active": -1}"#, r#"{"threads": 1}"#, r#"{}"#, "[1]"] {
        let reply = api.post("/v1/scaling", bad);
        assert_eq!(reply.status, 422, "{bad}: {}", reply.text);
    }
    assert_eq!(api.get("/v1/scaling").json()["active"], 2);
    drop(server);
}

#[test]
fn one_thread_has_nothing_to_scale() {
    let (server, api) = start(config(None));
    assert_eq!(api.get("/v1/scaling").json()["active"], 1);
    let reply = api.post("/v1/scaling", r#"{"active": 1}"#);
    assert_eq!(reply.status, 409, "{}", reply.text);
    drop(server);
}
