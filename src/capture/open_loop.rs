//! Open-loop replay of captured requests at their recorded start times.
