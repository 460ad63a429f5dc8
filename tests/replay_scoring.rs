//! The inline scorer against hand-written `events.jsonl` files (reference §17, acceptance list
//! §20 items 29–31), and inline accuracy end to end through a replay.

mod support;

use std::io::Write;

use agentrace::dataset::{Conversation, ExpectedReply};
use agentrace::replay::{self, scorer};
use serde_json::{json, Value};
use support::replay::{config, conversation, dataset, no_shutdown, start, Plan};

fn workflow_conv(id: &str, intents: &[&str]) -> Conversation {
    let mut c = conversation(id, 1, &[], "ls");
    c.client_turns[0].expected = Some(ExpectedReply {
        turn: 2,
        message: c.client_turns[0].history_len,
        tool_calls: None,
        intent_codes: Some(intents.iter().map(|s| s.to_string()).collect()),
    });
    c
}

fn write_events(lines: &[Value]) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    for l in lines {
        writeln!(f, "{l}").unwrap();
    }
    f
}

fn issued(uuid: &str, conv: &str, turn: u32) -> Value {
    json!({"event_type":"sample.issued","timestamp_ns":1,"sample_uuid":uuid,"conversation_id":conv,"turn":turn,
           "data":["PromptData",null,null,null,null,null,null,null]})
}

fn complete(uuid: &str, conv: &str, turn: u32, data: Value) -> Value {
    json!({"event_type":"sample.complete","timestamp_ns":2,"sample_uuid":uuid,"conversation_id":conv,"turn":turn,"data":data})
}

fn bash_output(cmd: &str) -> Value {
    let args = json!({"command": cmd}).to_string();
    json!(["TextModelOutput", "", ["Let me ", "look."], [
        [{"index":0,"id":"call_x","type":"function","function":{"name":"bash","arguments":""}}],
        [{"index":0,"function":{"arguments": &args[..10]}}],
        [{"index":0,"function":{"arguments": &args[10..]}}]
    ]])
}

// §20.31, §17.5: 3 issued turns (coding r1 = 1.0, workflow r1 with data null = 0, coding r2 =
// 1.0) score 0.6667 over 2 repeats: a partial repeat counts by issued turns. §20.29: both
// domains scored together, the headline is the turn-weighted mean.
#[test]
fn partial_repeat_counts_issued_turns_and_scores_0_6667() {
    let ds = dataset(vec![
        conversation("django__django-1", 1, &[], "grep -n x f.py"),
        workflow_conv("sim_000001", &["I000", "I057"]),
    ]);
    let ev = write_events(&[
        issued("a1", "django__django-1", 1),
        complete("a1", "django__django-1", 1, bash_output("grep -rn foo .")),
        issued("w1", "sim_000001", 1),
        complete("w1", "sim_000001", 1, Value::Null),
        issued("a2", "django__django-1__repeat_2", 1),
        complete(
            "a2",
            "django__django-1__repeat_2",
            1,
            bash_output("cd /t && grep y z"),
        ),
    ]);
    let s = scorer::score_events(ev.path(), &ds).unwrap();
    assert_eq!(s.score, Some(0.6667));
    assert_eq!(s.repeats, 2);
    let j = &s.json;
    assert_eq!(
        j["turns"],
        json!({"issued":3,"expected":3,"observed":2,"missing":1,"scored":3})
    );
    assert_eq!(j["domains"]["coding"], json!({"score":1.0,"scored":2}));
    assert_eq!(j["domains"]["workflow"], json!({"score":0.0,"scored":1}));
    let rows = j["per_turn"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    let wf = rows.iter().find(|r| r["domain"] == "workflow").unwrap();
    assert_eq!(wf["missing"], true);
    assert_eq!(wf["gt_intents"], json!(["I000", "I057"]));
    assert_eq!(wf["model_intent"], Value::Null);
    assert!(j.get("excluded_turns").is_none());
}

// §20.30, §17.1–17.2: turns without ground truth go to excluded_turns (the `echo` case) and out
// of the denominator; a client turn with no following assistant row is not even issued-counted;
// the Jaccard is a multiset ratio; workflow intents match explicit markers case-insensitively.
#[test]
fn unscorable_turns_are_excluded_and_partial_matches_score_fractionally() {
    let mut coding = conversation("astropy__astropy-1", 3, &[], "grep a b | head -3");
    let echo_only = json!([
        {"id":"x","type":"function","function":{"name":"bash","arguments":"{\"command\": \"echo hi > f\"}"}}
    ]);
    coding.client_turns[1].expected.as_mut().unwrap().tool_calls =
        Some(serde_json::value::to_raw_value(&echo_only).unwrap());
    coding.client_turns[2].expected = None; // conversation ends on a tool row
    let ds = dataset(vec![coding, workflow_conv("sim_000002", &["I058"])]);
    let ev = write_events(&[
        issued("t1", "astropy__astropy-1", 1),
        complete(
            "t1",
            "astropy__astropy-1",
            1,
            bash_output("grep a b | grep c | head"),
        ),
        issued("t2", "astropy__astropy-1", 3),
        complete("t2", "astropy__astropy-1", 3, bash_output("ls")),
        issued("t3", "astropy__astropy-1", 5),
        complete("t3", "astropy__astropy-1", 5, bash_output("ls")),
        issued("w", "sim_000002", 1),
        complete(
            "w",
            "sim_000002",
            1,
            json!(["TextModelOutput", "Done. INTENT: i058", null, null]),
        ),
    ]);
    let s = scorer::score_events(ev.path(), &ds).unwrap();
    // coding: gt [grep, head] vs model [grep, grep, head] → 2/3; workflow 1.0 → (0.6667+1)/2
    assert_eq!(s.json["per_turn"][0]["score"], 0.6667);
    assert_eq!(
        s.json["per_turn"][0]["model_actions"],
        json!(["grep", "grep", "head"])
    );
    assert_eq!(s.score, Some(0.8334));
    assert_eq!(
        s.json["turns"]["issued"], 3,
        "the turn with no assistant row is not counted"
    );
    assert_eq!(s.json["turns"]["expected"], 2);
    assert_eq!(
        s.json["excluded_turns"],
        json!([{"conversation_id":"astropy__astropy-1","turn":4,"domain":"coding","exclude_reason":"no ground truth"}])
    );
    assert_eq!(s.json["per_turn"][1]["model_intent"], "I058");
}

// Inline accuracy end to end: a server that answers every turn with the recorded command
// scores 1.0, one that answers `cd` scores 0, and the accuracy gate reports PASS / FAIL.
#[tokio::test]
async fn replay_scores_inline_and_reports_the_gate() {
    for (cmd, expect, pass) in [("grep -n x f.py", 1.0, true), ("cd /x", 0.0, false)] {
        let srv = start(move |_| Plan {
            content: vec![],
            reasoning: vec!["think".into()],
            bash: Some(cmd.into()),
            ..Default::default()
        })
        .await;
        let ds = dataset(vec![
            conversation("a", 3, &[], "grep -n x f.py"),
            conversation("b", 2, &[], "grep -n x f.py"),
        ]);
        let mut cfg = config(&srv.url(), 2);
        cfg.accuracy_threshold = Some(0.5);
        cfg.osl_band = Some([0.0, 1000.0]);
        let out = tempfile::tempdir().unwrap();
        let s = replay::run(cfg, ds, out.path(), no_shutdown())
            .await
            .unwrap();
        assert_eq!(s.accuracy, Some(expect));
        assert_eq!(s.gates_pass, pass);
        let scores: Value =
            serde_json::from_slice(&std::fs::read(out.path().join("scores.json")).unwrap())
                .unwrap();
        assert_eq!(scores["turns"]["observed"], 5);
        let report = std::fs::read_to_string(out.path().join("report.txt")).unwrap();
        let line = if pass {
            "PASS  inline_accuracy"
        } else {
            "FAIL  inline_accuracy"
        };
        assert!(report.contains(line), "{report}");
    }
}
